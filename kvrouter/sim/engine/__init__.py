"""The engine model of a simulated vLLM: pure, clock-free, shared by the live server and the evaluator."""

from ..errors import (
    DuplicateRequest,
    PublisherError,
    RequestRejected,
    RequestTooLong,
    SimConfigError,
    SimError,
    UnknownProfile,
)
from .engine import CacheConfig, Engine, EngineConfig, EngineMetrics, StepResult
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .frontend import FrontEnd
from .scheduler import RequestOutput, SchedulerConfig
from .timing import (
    NO_FRONTEND,
    PROFILES,
    VLLM_033_FRONTEND,
    FrontendCosts,
    LinearCost,
    PromptApi,
    TimingModel,
    TimingProfile,
    get_profile,
)
from .types import BlockHash, BlockId

__all__ = [
    "NO_FRONTEND",
    "PROFILES",
    "VLLM_033_FRONTEND",
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
    "FrontEnd",
    "FrontendCosts",
    "KVEvent",
    "LinearCost",
    "PromptApi",
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
