"""The indexer's error tree.  Each error carries a short ``reason`` used as a metric label.

IndexerError
├── DecodeError            a payload that is not a vLLM event batch (counted, batch dropped)
├── EventError             one event that cannot be applied (counted, event skipped)
│   ├── UnknownParent      BlockStored whose parent hash the source never stored
│   │   └── OffloadParentUnknown   the same for an offload tier's copy (retried, never degrades trust)
│   ├── BadBlockShape      token_ids do not cover block_hashes x block_size
│   ├── BlockSizeMismatch  the source's block size differs from the fleet's (loud: health + metrics)
│   └── SourceOverCapacity the source holds more blocks than its configured cap
└── ConfigError            an invalid fleet file or option
"""

from __future__ import annotations


class IndexerError(Exception):
    reason = "error"


class DecodeError(IndexerError):
    """A payload could not be decoded; ``reason`` says why (``msgpack``, ``batch_shape``...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class EventError(IndexerError):
    reason = "event"


class UnknownParent(EventError):
    reason = "unknown_parent"


class OffloadParentUnknown(UnknownParent):
    """A self-describing offload store (CPU/STORAGE) whose parent is unknown: offload tiers announce a
    batch's chunks in any order, and a chunk may outlive its parent's every copy."""

    reason = "offload_parent_unknown"


class BadBlockShape(EventError):
    reason = "bad_block_shape"


class BlockSizeMismatch(EventError):
    reason = "block_size_mismatch"

    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"block size {got} from events, fleet expects {expected}")
        self.expected = expected
        self.got = got


class SourceOverCapacity(EventError):
    reason = "source_over_capacity"


class ConfigError(IndexerError):
    reason = "config"
