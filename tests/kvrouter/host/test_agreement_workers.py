"""Routing quality with several workers: ``kvrouter agreement --workers 2`` (``kvrouter serve --workers 2``,
every request on a fresh connection, so requests sharing a prefix reach both workers) caches as much as
the simulation of one router does, and both workers routed part of the workload."""

from __future__ import annotations

from kvrouter.lab import agreement


def test_two_workers_cache_as_one_router_does() -> None:
    cfg = agreement.AgreementConfig(
        overrides={**agreement.DEFAULT_OVERRIDES, "num_groups": 6, "prompts_per_group": 10},
        instances=3,
        concurrency=8,
        workers=2,
    )
    res = agreement.check(cfg)
    assert res.live_errors == 0
    assert res.prompt_token_mismatches == 0
    assert res.per_worker is not None and set(res.per_worker) == {"0", "1"}
    assert all(n > 0 for n in res.per_worker.values()), res.per_worker
    assert sum(res.per_worker.values()) == res.requests
    assert 0.5 < res.sim_hit_rate < 1.0
    assert abs(res.difference) <= 0.02, agreement.report(res)
