"""The overload phases' figures: what came back at 2R and 4R, how soon, and why the gateway refused."""

from __future__ import annotations

import aiohttp

from kvrouter.lab.reliability.driver import Shot
from kvrouter.lab.reliability.figures import Figure, at_most, exactly, fig
from kvrouter.lab.reliability.procs import ServeProcess, metric
from kvrouter.percentiles import quantile


def p99_growth(shots: list[Shot]) -> float:
    """p99 latency of the answers sent in the last third of a phase over those of the first third."""
    if not shots:
        return float("nan")
    end = max(s.sent for s in shots)
    first = [s.latency_s for s in shots if s.sent < end / 3 and s.status in (200, 429)]
    last = [s.latency_s for s in shots if s.sent >= 2 * end / 3 and s.status in (200, 429)]
    return quantile(last, 0.99) / max(quantile(first, 0.99), 1e-6)


def overload_figures(r: float, cap: int, rate: float, o: dict[str, float], shots: list[Shot]) -> list[Figure]:
    """The figures of one overload phase at ``rate`` (``o``: its ``driver.summary``)."""
    k = f"{rate / r:.0f}R"
    r429 = [sh for sh in shots if sh.status == 429]
    with_ra = sum(1 for sh in r429 if sh.retry_after)
    ok_over = [sh.latency_s for sh in shots if sh.status == 200]
    rejected_ms = [sh.latency_s * 1e3 for sh in r429]
    return [
        fig(
            f"overload at {rate:.0f} req/s ({k}): 200 / 429 / other",
            f"{o['ok']:.0f} / {o['r429']:.0f} / {o['errors']:.0f}",
        ),
        exactly(f"{k}: errors other than 429", int(o["errors"]), 0),
        exactly(f"{k}: 429s carrying Retry-After (of {len(r429)})", with_ra, len(r429)),
        fig(
            f"{k}: 429 answer time p50 / p99",
            f"{quantile(rejected_ms, 0.5):.0f} / {quantile(rejected_ms, 0.99):.0f} ms",
        ),
        at_most(
            f"{k}: 429 answer time p50 / admitted requests' p50 (a refusal comes sooner than service)",
            quantile(rejected_ms, 0.5) / max(quantile(ok_over, 0.5) * 1e3, 1e-6),
            1.0,
            fmt="{:.2f}",
        ),
        at_most(
            f"{k}: p99 of the last third / of the first (a queue without bound keeps growing)",
            p99_growth(shots),
            1.5,
            fmt="{:.2f}",
        ),
        fig(
            f"{k}: admitted requests' p50 / p99 (max_requests {cap})",
            f"{quantile(ok_over, 0.5) * 1e3:.0f} / {quantile(ok_over, 0.99) * 1e3:.0f} ms",
        ),
    ]


REJECTION_REASONS = ("gateway_busy", "gateway_full", "queue_full", "queue_timeout")


async def rejections(gw: ServeProcess) -> dict[str, float]:
    """The gateway's refusals so far by reason (a counter: the host's /metrics sums its workers')."""
    async with aiohttp.ClientSession() as s:
        return {r: await metric(s, gw.base, "kvrouter_rejections_total", f'"{r}"') for r in REJECTION_REASONS}


def reasons(why: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in why.items() if v) or "none"
