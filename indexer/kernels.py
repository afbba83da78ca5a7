"""Every compiled kernel of the indexer, compiled (or loaded from numba's on-disk cache) in one go.

Numba compiles a kernel on its first call with each argument type, which takes seconds per kernel on a
busy machine: inside a request, an ingest or a test with a deadline, that is a stall.  ``compile_all``
drives a small index through every path that reaches a kernel (each release's payloads, fast and
reference ingest, removals, clears, offload tiers, lookups from lists and from arrays, holdings, snapshots) so
that later processes load them from the cache.  ``python -m indexer.kernels`` does it and lists the
kernels that no call from Python compiled (most are called only from other kernels, which compile them
as part of the caller).
"""

from __future__ import annotations

import importlib
import sys
import time

import numpy as np
from numba.core.registry import CPUDispatcher

from .encode import RELEASES, PayloadEncoder
from .hashing import request_chains
from .index import BlockIndex
from .indexer import Indexer
from .types import SourceKey

MODULES = (
    "indexer.hashing",
    "indexer.engine_table",
    "indexer.chain_table",
    "indexer.match_walk",
    "indexer.answers",
    "indexer.fast_wire",
    "indexer.fast_apply",
    "indexer.probing",
)
"""The modules holding compiled kernels."""

_BS = 16


def _drive(fast: bool) -> None:
    """One index through every kernel-backed path, for every release's wire shape."""
    ix = Indexer(_BS, fast_ingest=fast, max_blocks_per_source=4096)
    ix.reserve(4, 512)
    tokens = list(range(_BS * 8))
    for r, release in enumerate(RELEASES):
        enc = PayloadEncoder(release)
        src = SourceKey(f"v{r}", 0)
        assert isinstance(ix.index, BlockIndex)
        ix.index.slot_of(src)
        hashes = [1000 * (r + 1) + i for i in range(8)]
        first = enc.batch([enc.stored(hashes[:4], None, tokens[: 4 * _BS], _BS)], ts=1.0)
        more = enc.batch([enc.stored(hashes[4:], hashes[3], tokens[4 * _BS :], _BS)], ts=2.0)
        cpu = enc.batch([enc.stored(hashes[:2], None, tokens[: 2 * _BS], _BS, medium="CPU")], ts=2.5)
        for payload in (first, more, cpu, first):  # (the repeat: further references)
            ix.apply_payload(src.instance, payload)
        ix.lookup(tokens)
        ix.lookup(np.asarray(tokens, dtype=np.uint32))
        ix.lookup(tokens, lora_name="adapter", cache_salt="salt")
        removed = enc.batch([enc.removed(hashes[6:]), enc.removed(hashes[:1], medium="CPU")], ts=3.0)
        ix.apply_payload(src.instance, removed)
        ix.apply_payload(src.instance, enc.batch([enc.cleared()], ts=4.0))
        ix.apply_payload(src.instance, b"\xc1 not a payload")
        # the same prefix on a second source, sent for another rank than the caller names; lookups again
        twin = enc.batch([enc.stored(hashes[:4], None, tokens[: 4 * _BS], _BS)], ts=5.0, dp_rank=1)
        ix.apply_payload(src.instance, twin)
        ix.apply_payload(src.instance, first)
        for _ in range(2):
            ix.lookup(np.asarray(tokens, dtype=np.uint32))
            ix.lookup(np.asarray(tokens, dtype=np.int64))
        # how a source holds a prompt's blocks (the other replicas' queued prefill: ``PeerPrefill``)
        ix.holding(src, ix.chain_hashes(tokens))
    # a request's chains from the tokenizer's arrays (uint32), and from other integer arrays
    for dtype in (np.uint32, np.int64):
        request_chains(np.asarray(tokens, dtype=dtype), _BS)
    # a source outgrowing its reserved tables, then evicting through the reference path
    enc = PayloadEncoder()
    many = list(range(10**6, 10**6 + 1024))
    long_prompt = list(range(_BS * len(many)))
    ix.apply_payload("big", enc.batch([enc.stored(many, None, long_prompt, _BS)], ts=6.0))
    ix.lookup(long_prompt)
    ix.apply_payload("big", enc.batch([enc.removed(many[::2])], ts=7.0))
    Indexer(_BS, fast_ingest=fast, max_blocks_per_source=4096).restore(ix.snapshot(created_at=8.0))


def uncompiled() -> list[str]:
    """Cached kernels (``cache=True``) with no compiled signature in this process."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            cache = getattr(obj, "_cache", None)
            cached = isinstance(obj, CPUDispatcher) and type(cache).__name__ != "NullCache"
            if cached and not obj.signatures:
                out.append(f"{name}.{attr}")
    return out


def compile_all() -> list[str]:
    """Compile every kernel these paths reach; returns the cached kernels no call from Python compiled."""
    for fast in (True, False):
        _drive(fast)
    return uncompiled()


def main() -> int:
    t0 = time.perf_counter()
    left = compile_all()
    print(f"indexer kernels ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if left:
        print("compiled only inside their callers: " + ", ".join(left), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
