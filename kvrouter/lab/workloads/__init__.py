"""Workloads for ``kvrouter eval`` and the live demo: what requests are sent, and when.

Pure and deterministic: a workload is a function of its parameters and seed (no I/O except reading a
trace file).  ``make_workload(name, **overrides)`` builds a ``Workload(requests, mode, token_space,
metadata)`` from a generator or a trace; the evaluator hashes its blocks (``BlockContentCache``), bounds
it (``reuse_ceiling``) and summarizes it, and the live path materializes its prompts.

Modules: ``spec`` (Request, Workload, Segment, TokenSpace), ``tokens`` (deterministic token streams),
``text`` (synthetic words), ``blocks`` (block content hashes cached per segment), ``arrivals`` (arrival
processes), ``build`` (generator scaffolding), ``shared_prefix`` / ``chat`` / ``rag`` / ``tenants``
(generators), ``mooncake`` (trace loading), ``registry``, ``bounds`` (reuse ceiling), ``stats``,
``live`` (materialize, HTTP bodies), ``errors``.
"""

from kvrouter.lab.workloads.arrivals import (
    AllAtOnce,
    Arrival,
    Bursts,
    Constant,
    Poisson,
    Stage,
    Staged,
    arrival_times,
    scale_rate,
)
from kvrouter.lab.workloads.blocks import BlockContentCache, hash_token_array
from kvrouter.lab.workloads.bounds import reuse_ceiling, reuse_ceiling_by, reuse_hits
from kvrouter.lab.workloads.build import GeneratorParams, PromptForm
from kvrouter.lab.workloads.chat import MultiTurnParams, ShortChatParams
from kvrouter.lab.workloads.errors import (
    ChecksumMismatch,
    InvalidParameters,
    NotMaterialized,
    TraceFormatError,
    UnknownWorkload,
    WorkloadError,
)
from kvrouter.lab.workloads.live import (
    AFFINITY_HEADER,
    HttpCall,
    Tokenize,
    http_call,
    materialize,
    tokenize_with,
)
from kvrouter.lab.workloads.mooncake import (
    DEFAULT_TRACE_DIR,
    MooncakeOptions,
    id_reuse,
    load_mooncake,
    shipped_trace,
)
from kvrouter.lab.workloads.rag import RagParams
from kvrouter.lab.workloads.registry import (
    REGISTRY,
    MooncakeTraceParams,
    describe,
    list_workloads,
    make_workload,
    workload_params,
)
from kvrouter.lab.workloads.shared_prefix import (
    Aws8kParams,
    DynamoPrefixRatioParams,
    LlmdPreciseParams,
    LlmdSharedPrefixParams,
    LlmdTieredParams,
    SglangGspParams,
    SharedPrefixParams,
    VllmPrefixRepetitionParams,
)
from kvrouter.lab.workloads.spec import (
    ChatMessage,
    ClosedLoop,
    OpenLoop,
    Request,
    Segment,
    TokenSpace,
    Workload,
)
from kvrouter.lab.workloads.stats import summarize
from kvrouter.lab.workloads.tenants import TenantsParams
from kvrouter.lab.workloads.tokens import output_tokens, prompt_ids, prompt_tokens

__all__ = [
    "AFFINITY_HEADER",
    "DEFAULT_TRACE_DIR",
    "REGISTRY",
    "AllAtOnce",
    "Arrival",
    "Aws8kParams",
    "BlockContentCache",
    "Bursts",
    "ChatMessage",
    "ChecksumMismatch",
    "ClosedLoop",
    "Constant",
    "DynamoPrefixRatioParams",
    "GeneratorParams",
    "HttpCall",
    "InvalidParameters",
    "LlmdPreciseParams",
    "LlmdSharedPrefixParams",
    "LlmdTieredParams",
    "MooncakeOptions",
    "MooncakeTraceParams",
    "MultiTurnParams",
    "NotMaterialized",
    "OpenLoop",
    "Poisson",
    "PromptForm",
    "RagParams",
    "Request",
    "Segment",
    "SglangGspParams",
    "SharedPrefixParams",
    "ShortChatParams",
    "Stage",
    "Staged",
    "TenantsParams",
    "TokenSpace",
    "Tokenize",
    "TraceFormatError",
    "UnknownWorkload",
    "VllmPrefixRepetitionParams",
    "Workload",
    "WorkloadError",
    "arrival_times",
    "describe",
    "hash_token_array",
    "http_call",
    "id_reuse",
    "list_workloads",
    "load_mooncake",
    "make_workload",
    "materialize",
    "output_tokens",
    "prompt_ids",
    "prompt_tokens",
    "reuse_ceiling",
    "reuse_ceiling_by",
    "reuse_hits",
    "scale_rate",
    "shipped_trace",
    "summarize",
    "tokenize_with",
    "workload_params",
]
