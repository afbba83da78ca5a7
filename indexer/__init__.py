"""kvrouter's indexer: the live KV-cache state of a vLLM fleet, from vLLM's own KV events.

Pure core (no I/O): ``wire`` (decoding every release), ``encode`` (writing them), ``hashing`` (our chain
hash), ``index`` (the block index), ``sources`` (sequence tracking), ``core`` (``Indexer``).
I/O shells: ``subscriber`` (ZeroMQ SUB + replay), ``service`` (the aiohttp cache-hit API).
"""

from .core import Counters, Indexer, InstanceMatch, LookupResult
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
from .hashing import HASH_VERSION, base_hash, chain, content_hashes, request_chains
from .index import BlockIndex, SourceMatch
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
