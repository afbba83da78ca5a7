"""The request path, written once: parse, tokenize, hash, look up, decide within limits, record the
dispatch; release the load and read the reported cached tokens when the answer is known.

Front doors are thin shells around ``RequestPipeline``: ``gateway`` (the aiohttp proxy) and ``epp`` (the
Endpoint Picker behind Envoy).  No routing step is written twice.

::

    pipeline.py       RequestPipeline, Prepared, explain
    tokens.py         TokenSource (the tokenizing seam), PassThroughTokens
    fleet_tokens.py   FleetTokens: the tokenizer cache, one tokenizer per served model
    gate.py           CapacityGate: a bounded FIFO wait for capacity
    metrics.py        PipelineMetrics: decisions, shadow scoring, predicted vs reported cached tokens
    trace_steps.py    what each step puts on its span when a request is traced (``kvrouter.telemetry``)
"""

from .fleet_tokens import FleetTokens
from .gate import CapacityGate, QueueFull
from .metrics import PipelineMetrics
from .pipeline import SAGEMAKER_AFFINITY, Fleet, Prepared, RequestPipeline, explain
from .tokens import PassThroughTokens, TokenSource

__all__ = [
    "SAGEMAKER_AFFINITY",
    "CapacityGate",
    "Fleet",
    "FleetTokens",
    "PassThroughTokens",
    "PipelineMetrics",
    "Prepared",
    "QueueFull",
    "RequestPipeline",
    "TokenSource",
    "explain",
]
