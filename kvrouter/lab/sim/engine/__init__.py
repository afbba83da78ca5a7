"""The engine model of a simulated vLLM: pure, clock-free, shared by the live server and the evaluator."""

from kvrouter.lab.sim.engine.engine import CacheConfig, Engine, EngineConfig, EngineMetrics, StepResult
from kvrouter.lab.sim.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.frontend import FrontEnd
from kvrouter.lab.sim.engine.scheduler import RequestOutput, SchedulerConfig
from kvrouter.lab.sim.engine.timing import (
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
from kvrouter.lab.sim.engine.types import BlockHash, BlockId
from kvrouter.lab.sim.errors import (
    DuplicateRequest,
    PublisherError,
    RequestRejected,
    RequestTooLong,
    SimConfigError,
    SimError,
    UnknownProfile,
)

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
