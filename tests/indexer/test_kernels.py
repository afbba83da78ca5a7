"""``indexer.kernels`` drives every kernel-backed path before a test run (``make kernels``)."""

from __future__ import annotations

from indexer import kernels


def test_compile_all_reaches_the_kernels_called_from_python() -> None:
    left = kernels.compile_all()
    # called from Python only on paths the drive must take: growth, offload tiers, both ingest paths
    for name in ("engine_table.et_rehash", "fast_apply.ingest", "hashing._chain", "match_walk._walk"):
        assert f"indexer.{name}" not in left
    assert set(left) <= {f"{m}.{a}" for m in kernels.MODULES for a in dir(__import__(m, fromlist=["x"]))}
