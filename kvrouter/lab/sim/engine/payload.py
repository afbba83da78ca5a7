"""Writing a step's events as one vLLM batch payload, in any release's wire shape (pure, no sockets).

Differences between releases are the encoder's business (``indexer.encode.PayloadEncoder``: positional
events up to 0.23, maps from 0.24, no rank on 0.9, fields only ever appended); this module maps the
engine's events onto it and applies the value rules the encoder cannot know:

* GPU stores: ``group_idx`` 0 from 0.20; from 0.23 ``kv_cache_spec_kind`` "full_attention" (vLLM's
  KV-cache manager labels each store with its group's kind in ``take_events``; the engine models one
  full-attention group);
* GPU evictions: ``group_idx`` 0 from 0.20 (the block pool's ``group_idx=get_group_id(hash)``);
* the CPU tier's and the shared store's events (the offloading connector's): on 0.33 ``group_idx`` 0 on
  stores and removals; placeholders (no tokens) carry no ``extra_keys`` nor kind and ``block_size`` 0,
  self-describing stores the kind; before 0.33 (not recorded) no ``group_idx``.

The GPU rules are checked against vLLM's own output: byte for byte against payloads written by each
release's classes (tests/fixtures/wire) and, on 0.33, against the events of vLLM's scheduler and block
pool (tests/fixtures/vllm_scheduler); the offload rules against vLLM 0.33's connector
(tests/fixtures/vllm_offload).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from indexer.encode import PayloadEncoder, version_tuple
from kvrouter.lab.sim.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class PayloadWriter:
    """Encodes event batches for one release and one data-parallel rank."""

    def __init__(self, release: str = "0.33.0", dp_rank: int = 0) -> None:
        self.encoder = PayloadEncoder(release)
        self.release = release
        self.dp_rank = dp_rank
        self._placeholder_size_zero = version_tuple(release) >= (0, 33, 0)
        self._gpu_removed_group: int | None = 0 if version_tuple(release) >= (0, 20, 0) else None
        self._offload_group: int | None = 0 if version_tuple(release) >= (0, 33, 0) else None
        self._gpu_spec_kind = "full_attention" if version_tuple(release) >= (0, 23, 0) else None

    def payload(self, events: Sequence[KVEvent], ts: float) -> bytes:
        """``[ts, events, data_parallel_rank]`` (``[ts, events]`` on 0.9) as the release writes it.

        Runs of one-hash removals (one per evicted block, the bulk of a busy engine's events) are encoded
        in one vectorised step; the bytes are those of encoding each event on its own."""
        enc = self.encoder
        parts: list[bytes] = []
        pending: list[msgspec.Struct] = []
        run: list[int] = []
        run_medium: str | None = None
        encode = msgspec.msgpack.encode

        def group_of(medium: str | None) -> int | None:
            return self._gpu_removed_group if medium == "GPU" else self._offload_group

        def flush_run() -> None:
            if run:
                parts.append(enc.removed_run(run, run_medium, group_of(run_medium)))
                run.clear()

        for ev in events:
            if isinstance(ev, BlockRemoved) and len(ev.block_hashes) == 1:
                if run and ev.medium != run_medium:
                    flush_run()
                run_medium = ev.medium
                run.append(ev.block_hashes[0])
                continue
            flush_run()
            match ev:
                case BlockStored():
                    placeholder = not ev.token_ids and ev.medium != "GPU"
                    pending.append(
                        enc.stored(
                            ev.block_hashes,
                            ev.parent_block_hash,
                            ev.token_ids,
                            0 if placeholder and self._placeholder_size_zero else ev.block_size,
                            medium=ev.medium,
                            lora_id=ev.lora_id,
                            lora_name=ev.lora_name,
                            extra_keys=None
                            if ev.extra_keys is None
                            else [list(k) if k else None for k in ev.extra_keys],
                            group_idx=group_of(ev.medium) if placeholder else 0,
                            kv_cache_spec_kind=None if placeholder else self._gpu_spec_kind,
                        )
                    )
                case BlockRemoved():
                    pending.append(
                        enc.removed(ev.block_hashes, medium=ev.medium, group_idx=group_of(ev.medium))
                    )
                case AllBlocksCleared():
                    pending.append(enc.cleared())
            parts.append(encode(pending.pop()))
        flush_run()
        return enc.batch_of_encoded(parts, len(events), ts=ts, dp_rank=self.dp_rank)
