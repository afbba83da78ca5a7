"""KV-cache events as the engine model emits them: plain values in an outbox, never sent from here.

They restate vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (vllm/distributed/kv_events.py)
with the fields a router can observe; ``publisher.py`` writes them in any release's wire shape.  One engine
step's events form one batch, in the order they happened::

    step k:  [BlockRemoved(h9)] [BlockRemoved(h8)] [BlockStored(h1..h4, parent=None)]  <- request A's chunk
             [BlockStored(h5, parent=h4)]                                              <- request B's decode
             [BlockStored(h1..h4, medium=CPU, token_ids=[])]                           <- offload placeholders

Invariants (what vLLM guarantees and the tests check):

* ``BlockStored.token_ids`` are exactly the tokens of its blocks: ``len == len(block_hashes) * block_size``,
  except offload placeholders (medium ``CPU``), which carry no tokens and the GPU blocks' hashes;
* ``parent_block_hash`` is None only for a sequence's first block, otherwise the hash of the block before;
* GPU ``BlockRemoved`` carries one hash per event (one event per evicted block); the CPU tier removes all
  blocks evicted by one store in one event, as vLLM's offloading manager does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvrouter.lab.sim.engine.types import BlockHash, MediumName

ExtraKeys = tuple[Any, ...] | None
"""One block's extra hash keys as vLLM reports them: LoRA name first, the block's multimodal ``(identifier,
offset)`` pairs, then ``cache_salt`` (block 0 only)."""


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: MediumName = "GPU"
    extra_keys: list[ExtraKeys] | None = None
    """One entry per block (vLLM >= 0.20 always sends the list for GPU stores); None for placeholders."""


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[BlockHash]
    medium: MediumName = "GPU"


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
