"""The overload phases' figures: what came back at 2R and 4R, how soon, and why the gateway refused."""

from __future__ import annotations

import aiohttp

from kvrouter.lab.reliability.driver import Shot
from kvrouter.lab.reliability.figures import Figure, at_most, exactly, fig
from kvrouter.lab.reliability.procs import ServeProcess, metric
from kvrouter.percentiles import quantile


def p99_growth(shots: list[Shot], floor_s: float) -> float:
    """p99 latency of the answers sent in the last third of a phase over those of the first third, the
    first third's taken as at least ``floor_s`` (a latency the ramp calls held: growth below it is not a
    queue without bound)."""
    if not shots:
        return float("nan")
    end = max(s.sent for s in shots)
    first = [s.latency_s for s in shots if s.sent < end / 3 and s.status in (200, 429)]
    last = [s.latency_s for s in shots if s.sent >= 2 * end / 3 and s.status in (200, 429)]
    return quantile(last, 0.99) / max(quantile(first, 0.99), floor_s)


def same_second_ratio(shots: list[Shot]) -> float:
    """The median, over the seconds of a phase with both answers, of the 429s' p50 latency over the 200s'
    p50 sent in the same second.  Admission by the loop's delay refuses exactly while the loop is behind,
    so across a whole phase refusals meet the busy moments and admissions the quiet ones; within one
    second both meet the same loop.  NaN when no second had both."""
    by_s: dict[int, tuple[list[float], list[float]]] = {}
    for sh in shots:
        if sh.status in (200, 429):
            ok, no = by_s.setdefault(int(sh.sent), ([], []))
            (ok if sh.status == 200 else no).append(sh.latency_s)
    ratios = [quantile(no, 0.5) / max(quantile(ok, 0.5), 1e-6) for ok, no in by_s.values() if ok and no]
    return quantile(ratios, 0.5) if ratios else float("nan")


def overload_figures(
    r: float, cap: int, rate: float, o: dict[str, float], shots: list[Shot], held_p99_s: float
) -> list[Figure]:
    """The figures of one overload phase at ``rate`` (``o``: its ``driver.summary``; ``held_p99_s``: the
    p99 the ramp holds a rate to)."""
    k = f"{rate / r:.0f}R"
    r429 = [sh for sh in shots if sh.status == 429]
    with_ra = sum(1 for sh in r429 if sh.retry_after)
    ok_over = [sh.latency_s for sh in shots if sh.status == 200]
    rejected_ms = [sh.latency_s * 1e3 for sh in r429]
    out = [
        fig(
            f"overload at {rate:.0f} req/s ({k}): 200 / 429 / other",
            f"{o['ok']:.0f} / {o['r429']:.0f} / {o['errors']:.0f}",
        ),
        exactly(f"{k}: errors other than 429", int(o["errors"]), 0),
        exactly(f"{k}: 429s carrying Retry-After (of {len(r429)})", with_ra, len(r429)),
    ]
    if r429:
        ratio = same_second_ratio(shots)
        out += [
            fig(
                f"{k}: 429 answer time p50 / p99",
                f"{quantile(rejected_ms, 0.5):.0f} / {quantile(rejected_ms, 0.99):.0f} ms",
            ),
            fig(
                f"{k}: 429 answer time p50 / admitted requests' p50, whole phase",
                quantile(rejected_ms, 0.5) / max(quantile(ok_over, 0.5) * 1e3, 1e-6),
                fmt="{:.2f}",
            ),
            fig(
                f"{k}: ... sent in the same second (median over the seconds; a 429 sooner than a 200)",
                ratio,
                "<= 1.00",
                bool(ratio <= 1.0),  # NaN (no second with both): fails
                fmt="{:.2f}",
            ),
        ]
    else:
        out.append(fig(f"{k}: 429s", "none: the gateway kept up at this rate"))
    out += [
        at_most(
            f"{k}: p99 of the last third / of the first, at least {held_p99_s * 1e3:.0f} ms (a queue "
            "without bound keeps growing)",
            p99_growth(shots, held_p99_s),
            1.5,
            fmt="{:.2f}",
        ),
        fig(
            f"{k}: admitted requests' p50 / p99 (max_requests {cap})",
            f"{quantile(ok_over, 0.5) * 1e3:.0f} / {quantile(ok_over, 0.99) * 1e3:.0f} ms",
        ),
    ]
    return out


REJECTION_REASONS = ("gateway_busy", "gateway_full", "queue_full", "queue_timeout")


async def rejections(gw: ServeProcess) -> dict[str, float]:
    """The gateway's refusals so far by reason (a counter: the host's /metrics sums its workers')."""
    async with aiohttp.ClientSession() as s:
        return {r: await metric(s, gw.base, "kvrouter_rejections_total", f'"{r}"') for r in REJECTION_REASONS}


def reasons(why: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in why.items() if v) or "none"
