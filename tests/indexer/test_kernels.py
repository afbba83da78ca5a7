"""``indexer.kernels`` drives every kernel-backed path before a test run (``make kernels``)."""

from __future__ import annotations

from indexer import kernels


def test_compile_all_reaches_the_kernels_called_from_python() -> None:
    left = kernels.compile_all()
    # called from Python only on paths the drive must take: growth, offload tiers, both ingest paths
    # ... ``holding``'s, which only replicas sharing state call (left out, it compiled for 2 s in every
    # leader worker at once on a fresh install's first requests, and their connects timed out), and the
    # hashing of a request's token array
    called = ("engine_table.et_rehash", "fast_apply.ingest", "hashing._chain", "match_walk._walk")
    for name in (*called, "chain_table.ct_kinds", "hashing._array_blocks"):
        assert f"indexer.{name}" not in left
    assert set(left) <= {f"{m}.{a}" for m in kernels.MODULES for a in dir(__import__(m, fromlist=["x"]))}
