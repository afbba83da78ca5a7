"""kvrouter's indexer: the live KV-cache state of a vLLM fleet, from vLLM's own KV events.

Pure core (no I/O): ``wire`` (decoding every release), ``encode`` (writing them), ``hashing`` (our chain
hash), ``index`` (the block index), ``sources`` (sequence tracking), ``event_applier`` (events into the
index), ``indexer`` (``Indexer``, the library API).
I/O shells: ``subscriber`` (ZeroMQ SUB + replay), ``service`` (the aiohttp cache-hit API).
"""

from .answers import InstanceMatch, LookupResult
from .errors import (
    BadBlockShape,
    BlockSizeMismatch,
    ConfigError,
    DecodeError,
    EventError,
    IndexerError,
    SourceOverCapacity,
    UnknownParent,
)
from .event_applier import Counters
from .hashing import HASH_VERSION, base_hash, chain, content_hashes, request_chains
from .index import BlockIndex, SourceMatch
from .indexer import Indexer
from .types import ChainHash, EngineHash, InstanceId, Medium, SourceKey, Trust

__all__ = [
    "HASH_VERSION",
    "BadBlockShape",
    "BlockIndex",
    "BlockSizeMismatch",
    "ChainHash",
    "ConfigError",
    "Counters",
    "DecodeError",
    "EngineHash",
    "EventError",
    "Indexer",
    "IndexerError",
    "InstanceId",
    "InstanceMatch",
    "LookupResult",
    "Medium",
    "SourceKey",
    "SourceMatch",
    "SourceOverCapacity",
    "Trust",
    "UnknownParent",
    "base_hash",
    "chain",
    "content_hashes",
    "request_chains",
]
