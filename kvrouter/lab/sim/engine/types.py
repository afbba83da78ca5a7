"""Named types of the simulated engine.

``BlockHash`` is the engine's own block hash, the value a vLLM instance puts in ``block_hashes`` of its KV
events (an unsigned 64-bit int, like vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).  It is the
indexer's ``EngineHash``: opaque to the router, meaningful only within one engine.  ``BlockId`` is a
physical slot of the paged pool, never sent anywhere.
"""

from __future__ import annotations

from typing import Literal, NewType

BlockHash = NewType("BlockHash", int)
"""The engine's hash of one full block and everything before it, 0 <= h < 2**64."""

BlockId = NewType("BlockId", int)
"""A physical block of the KV pool, 0 <= id < capacity."""

MediumName = Literal["GPU", "CPU", "STORAGE"]
"""Where a block lives, as vLLM names it in events."""

FinishReason = Literal["length", "abort"]
"""Why a request stopped: it produced ``max_tokens`` tokens, or it was aborted (client gone, restart)."""
