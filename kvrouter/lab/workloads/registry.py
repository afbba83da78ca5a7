"""The named workloads: ``list_workloads()``, ``make_workload(name, **overrides)``.

Each entry pairs a parameter class (a msgspec Struct whose defaults are the peer's published parameters,
documented per field) with a builder, plus ``hints``: settings meant for the evaluator, such as the
number of instances the peer used, which the workload records but does not act on.

Names: ``aws-8k-shared-prefix``, ``sglang-gsp``, ``vllm-prefix-repetition``, ``llmd-precise``,
``llmd-shared-prefix``, ``llmd-tiered``, ``multi-turn``, ``dynamo-prefix-ratio``, ``rag``, ``tenants``,
``multimodal-agent``,
``short-chat``, ``mooncake-conversation`` and ``mooncake-synthetic`` (the Kimi traces).
``kvrouter eval --list`` prints each with its defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
from msgspec import Struct

from kvrouter.lab.workloads.chat import MultiTurnParams, ShortChatParams, multi_turn, short_chat
from kvrouter.lab.workloads.errors import InvalidParameters, UnknownWorkload
from kvrouter.lab.workloads.mooncake import MooncakeOptions, load_mooncake, shipped_trace
from kvrouter.lab.workloads.multimodal import MultimodalAgentParams, multimodal_agent
from kvrouter.lab.workloads.rag import RagParams, rag
from kvrouter.lab.workloads.shared_prefix import (
    Aws8kParams,
    DynamoPrefixRatioParams,
    LlmdPreciseParams,
    LlmdSharedPrefixParams,
    LlmdTieredParams,
    SglangGspParams,
    VllmPrefixRepetitionParams,
    dynamo_prefix_ratio,
    shared_prefix,
)
from kvrouter.lab.workloads.spec import Workload, plain
from kvrouter.lab.workloads.tenants import TenantsParams, tenants


class MooncakeTraceParams(MooncakeOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A Mooncake trace file and how to load it."""

    path: str | None = None
    """The trace file; None: the shipped file of the workload's name (``shipped_trace``)."""


class WorkloadEntry(Struct, frozen=True):
    """One named workload."""

    params_type: type[Struct]
    """Parameter class; its defaults are the workload's."""
    build: Callable[[str, Any], Workload]
    """``build(name, params)``."""
    description: str
    hints: Mapping[str, Any]
    """Evaluator settings the peer used (recorded in ``metadata["hints"]``)."""


def _mooncake(file: str) -> Callable[[str, Any], Workload]:
    def build(name: str, params: MooncakeTraceParams) -> Workload:
        path = Path(params.path) if params.path else shipped_trace(file)
        return load_mooncake(path, params, name=name)

    return build


REGISTRY: Mapping[str, WorkloadEntry] = MappingProxyType(
    {
        "aws-8k-shared-prefix": WorkloadEntry(
            Aws8kParams, shared_prefix, "AWS SageMaker PREFIX_AWARE test: one 8k-token shared prefix",
            {"instances": 7, "model": "Llama 3.1 70B", "duration_s": 3600},
        ),
        "sglang-gsp": WorkloadEntry(
            SglangGspParams, shared_prefix, "SGLang generated-shared-prefix", {"instances": 8}
        ),
        "vllm-prefix-repetition": WorkloadEntry(
            VllmPrefixRepetitionParams, shared_prefix, "vLLM bench prefix_repetition", {"instances": 8}
        ),
        "llmd-precise": WorkloadEntry(
            LlmdPreciseParams, shared_prefix, "llm-d precise-prefix-cache guide (headline)",
            {"instances": 8, "model": "Qwen3-32B"},
        ),
        "llmd-shared-prefix": WorkloadEntry(
            LlmdSharedPrefixParams, shared_prefix, "llm-d-benchmark shared_prefix_synthetic", {"instances": 8}
        ),
        "llmd-tiered": WorkloadEntry(
            LlmdTieredParams, shared_prefix, "llm-d tiered-prefix-cache guide", {"instances": 8}
        ),
        "multi-turn": WorkloadEntry(
            MultiTurnParams, multi_turn, "multi-turn chat growing turn by turn", {"instances": 8}
        ),
        "dynamo-prefix-ratio": WorkloadEntry(
            DynamoPrefixRatioParams, dynamo_prefix_ratio, "NVIDIA Dynamo router prefix-ratio benchmark",
            {"instances": 8, "model": "Qwen3-32B"},
        ),
        "rag": WorkloadEntry(RagParams, rag, "RAG over a document set", {"instances": 8}),
        "multimodal-agent": WorkloadEntry(
            MultimodalAgentParams, multimodal_agent,
            "computer-use agents resending screenshots; documents with figures shared across users",
            {"instances": 8, "model": "Qwen2.5-VL-72B", "profile": "qwen2.5-vl-72b-8xh100"},
        ),
        "tenants": WorkloadEntry(
            TenantsParams, tenants, "tenants sending the same prompts under their own cache_salt",
            {"instances": 4},
        ),
        "short-chat": WorkloadEntry(
            ShortChatParams, short_chat, "ShareGPT-like short chats, little sharing (AWS's weak case)",
            {"instances": 7},
        ),
        "mooncake-conversation": WorkloadEntry(
            MooncakeTraceParams, _mooncake("conversation_trace.jsonl"), "Mooncake FAST'25 conversation trace",
            {"instances": 8},
        ),
        "mooncake-synthetic": WorkloadEntry(
            MooncakeTraceParams, _mooncake("synthetic_trace.jsonl"), "Mooncake FAST'25 synthetic trace",
            {"instances": 8},
        ),
    }
)  # fmt: skip


def list_workloads() -> list[str]:
    """Registered workload names, sorted."""
    return sorted(REGISTRY)


def _entry(name: str) -> WorkloadEntry:
    entry = REGISTRY.get(name)
    if entry is None:
        raise UnknownWorkload(f"unknown workload {name!r}; known: {', '.join(list_workloads())}")
    return entry


def workload_params(name: str, **overrides: Any) -> Struct:
    """The parameters ``make_workload(name, **overrides)`` would use, validated.

    Overrides are converted with msgspec: nested values may be given as Structs or as plain data
    (``arrival={"type": "poisson", "rate": 5}``).  Raises ``InvalidParameters``."""
    entry = _entry(name)
    merged = {**msgspec.structs.asdict(entry.params_type()), **overrides}
    try:
        return msgspec.convert(merged, entry.params_type)
    except msgspec.ValidationError as e:
        raise InvalidParameters(f"{name}: {e}") from None


def describe(name: str) -> dict[str, Any]:
    """Description, default parameters (as plain data) and evaluator hints of a workload."""
    entry = _entry(name)
    return {
        "name": name,
        "description": entry.description,
        "params": plain(entry.params_type()),
        "hints": dict(entry.hints),
    }


def make_workload(name: str, **overrides: Any) -> Workload:
    """Build the named workload with its defaults, except for ``overrides``."""
    entry = _entry(name)
    workload = entry.build(name, workload_params(name, **overrides))
    workload.metadata["hints"] = {**entry.hints, **workload.metadata.get("hints", {})}
    workload.metadata["description"] = entry.description
    return workload
