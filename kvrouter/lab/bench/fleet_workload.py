"""The fleet-scale indexer workload, in the standard library only.

kvrouter's bench (``kvrouter bench indexer --instances N --blocks M``) and the Dynamo peer runner
(``dynamo_fleet.py``, a subprocess in the peer's venv, which has neither numpy nor kvrouter) both import
this file, so both index the same token streams, block for block.

Shape: ``prefixes`` shared prompts of ``prefix_blocks`` blocks; sequences of ``seq_blocks`` blocks, each a
prefix plus its own tail; every instance takes random sequences until it holds ``blocks`` blocks.  An
instance reports a sequence's prefix blocks only the first time it sees that prefix (then the tail alone,
its parent being the prefix's last block), as vLLM's events do.  Sequences arrive interleaved across
instances.  Then ``remove_frac`` of the sequences lose their tails (leaf first).  Queries: a live
sequence's first ``cached_blocks`` blocks plus new tokens, ``query_blocks`` blocks in all.

Token ids are 16-bit values from ``random.Random(seed).randbytes`` (identical across processes); engine
hashes are plain counters (opaque ids, unique per block; prefix blocks share theirs across instances).
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from collections.abc import Iterator

PREFIX_ENGINE_BASE = 1 << 60


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    instances: int = 100
    blocks: int = 100_000
    """Blocks each instance holds after the stores."""
    prefixes: int = 50
    prefix_blocks: int = 64
    seq_blocks: int = 128
    block_size: int = 16
    cached_blocks: int = 100
    query_blocks: int = 512
    queries: int = 2000
    remove_frac: float = 0.1
    seed: int = 1234


class Fleet:
    """The plan of one workload: which instance gets which sequence, in arrival order."""

    def __init__(self, spec: FleetSpec) -> None:
        if not spec.prefix_blocks < spec.cached_blocks <= spec.seq_blocks <= spec.query_blocks:
            raise ValueError("need prefix_blocks < cached_blocks <= seq_blocks <= query_blocks")
        self.spec = spec
        rng = random.Random(spec.seed)
        tail = spec.seq_blocks - spec.prefix_blocks
        inst, pref = array("i"), array("h")
        for i in range(spec.instances):
            held, seen = 0, set()
            while held < spec.blocks:
                p = rng.randrange(spec.prefixes)
                held += tail + (0 if p in seen else spec.prefix_blocks)
                seen.add(p)
                inst.append(i)
                pref.append(p)
        order = list(range(len(inst)))
        rng.shuffle(order)
        self.inst = array("i", (inst[o] for o in order))
        self.pref = array("h", (pref[o] for o in order))
        self.first = array("b")  # the sequence brings its prefix's blocks (first of it on its instance)
        seen_pairs: set[int] = set()
        for s in range(len(self.inst)):
            key = self.inst[s] * spec.prefixes + self.pref[s]
            self.first.append(0 if key in seen_pairs else 1)
            seen_pairs.add(key)
        n = len(self.inst)
        self.removed = sorted(rng.sample(range(n), round(spec.remove_frac * n)))
        gone = set(self.removed)
        live = [s for s in range(n) if s not in gone]
        self.query_seqs = [rng.choice(live) for _ in range(spec.queries)]
        self._prefix_tokens = [
            random.Random(f"prefix-{spec.seed}-{p}").randbytes(2 * spec.prefix_blocks * spec.block_size)
            for p in range(spec.prefixes)
        ]

    def __len__(self) -> int:
        return len(self.inst)

    def pairs(self) -> int:
        """(instance, block) pairs held after the stores."""
        tail = self.spec.seq_blocks - self.spec.prefix_blocks
        return len(self) * tail + sum(self.first) * self.spec.prefix_blocks

    def removed_blocks(self) -> int:
        return len(self.removed) * (self.spec.seq_blocks - self.spec.prefix_blocks)

    # ------------------------------------------------------------------ one sequence
    def prefix_tokens(self, p: int) -> bytes:
        """uint16 little-endian token ids."""
        return self._prefix_tokens[p]

    def tail_tokens(self, s: int) -> bytes:
        sp = self.spec
        n = (sp.seq_blocks - sp.prefix_blocks) * sp.block_size
        return random.Random(f"tail-{sp.seed}-{s}").randbytes(2 * n)

    def prefix_engines(self, p: int) -> range:
        base = PREFIX_ENGINE_BASE + p * self.spec.prefix_blocks
        return range(base, base + self.spec.prefix_blocks)

    def tail_engines(self, s: int) -> range:
        sp = self.spec
        base = (s + 1) * sp.seq_blocks
        return range(base + sp.prefix_blocks, base + sp.seq_blocks)

    def stored(self, s: int) -> tuple[int, int | None, list[int], bytes, bool]:
        """(instance, parent engine hash, engine hashes, uint16 tokens, prefix included) of sequence s."""
        p = self.pref[s]
        tail_e = list(self.tail_engines(s))
        if self.first[s]:
            toks = self.prefix_tokens(p) + self.tail_tokens(s)
            return self.inst[s], None, [*self.prefix_engines(p), *tail_e], toks, True
        return self.inst[s], self.prefix_engines(p)[-1], tail_e, self.tail_tokens(s), False

    def stores(self) -> Iterator[tuple[int, int | None, list[int], bytes, bool]]:
        for s in range(len(self)):
            yield self.stored(s)

    def removals(self) -> Iterator[tuple[int, list[int]]]:
        """(instance, tail engine hashes leaf first) of each sequence losing its tail."""
        for s in self.removed:
            yield self.inst[s], list(reversed(self.tail_engines(s)))

    # ------------------------------------------------------------------ queries
    def query(self, q: int) -> tuple[int, bytes]:
        """(instance expected to match ``cached_blocks``, uint16 tokens of ``query_blocks`` blocks)."""
        sp = self.spec
        s = self.query_seqs[q]
        own = (sp.cached_blocks - sp.prefix_blocks) * sp.block_size * 2
        n = (sp.query_blocks - sp.cached_blocks) * sp.block_size
        new = random.Random(f"query-{sp.seed}-{q}").randbytes(2 * n)
        return self.inst[s], self.prefix_tokens(self.pref[s]) + self.tail_tokens(s)[:own] + new
