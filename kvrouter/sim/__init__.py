"""A simulated vLLM instance, faithful to vLLM wherever a router can tell.

Pure engine model (no asyncio, no zmq, no clock; shared by the live simulator and the trace-driven
evaluator): ``blockpool`` (paged KV pool with prefix caching and events), ``offload`` (CPU tier),
``kvcache`` (per-request block tables), ``scheduler`` (continuous batching), ``timing`` (step durations and
named hardware profiles), ``engine`` (the facade).  I/O shell: ``publisher`` (ZeroMQ PUB + replay ROUTER,
any vLLM release's wire format, fault knobs).
"""

from .engine.engine import CacheConfig, Engine, EngineConfig, EngineMetrics, StepResult
from .engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .engine.scheduler import RequestOutput, SchedulerConfig
from .engine.timing import PROFILES, TimingModel, TimingProfile, get_profile
from .engine.types import BlockHash, BlockId
from .errors import (
    DuplicateRequest,
    PublisherError,
    RequestRejected,
    RequestTooLong,
    SimConfigError,
    SimError,
    UnknownProfile,
)

__all__ = [
    "PROFILES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockId",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "DuplicateRequest",
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "KVEvent",
    "PublisherError",
    "RequestOutput",
    "RequestRejected",
    "RequestTooLong",
    "SchedulerConfig",
    "SimConfigError",
    "SimError",
    "StepResult",
    "TimingModel",
    "TimingProfile",
    "UnknownProfile",
    "get_profile",
]
