"""Who goes first under saturation: the flows evaluation (``kvrouter eval --flows``) as a notebook's tables
and figures, and the live scenario's recorded figures beside it.

``flows_spec(scale)`` sizes the evaluation's trace (``evaluation.flows.FlowsSpec``); ``targets_table``
sets each fairness mode's figures beside the issue's targets, per load; ``tenants_table`` gives every
tenant's TTFT p99 per mode; ``p99_bars`` draws the interactive tenants' TTFT p99 against alone per mode;
``LIVE`` holds what ``python -m kvrouter.lab.flows_live`` measured through one process, two workers and
two replicas (the command and date with each row).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvrouter.lab.evaluation.flows import FlowsSpec
from kvrouter.lab.report.plots import Chart, _plain_log
from kvrouter.lab.report.scale import Scale
from kvrouter.lab.report.tables import Table

Report = dict[str, Any]

TARGETS = {
    "ttft_p99_vs_alone": 1.2,
    "high_p99_vs_no_batch": 1.05,
    "jain_work": 0.95,
    "throughput_vs_fifo": 0.98,
}
"""The issue's targets: each at most (the first two) or at least (the last two) this."""


class LiveRow(msgspec.Struct, frozen=True):
    setup: str
    fairness: str
    alone_p90_ms: float
    flood_p90_ms: float
    command: str


LIVE: tuple[LiveRow, ...] = (
    # 2026-12-04, one bench at a time on the 2-core machine; --modes work,fifo unless said
    LiveRow("serve --workers 1", "work", 7.7, 19.1, "flows_live"),
    LiveRow("serve --workers 1", "fifo", 8.1, 182.6, "flows_live"),
    LiveRow("serve --workers 2", "work", 8.6, 23.5, "flows_live --workers 2"),
    LiveRow("serve --workers 2", "fifo", 6.4, 101.8, "flows_live --workers 2"),
    LiveRow("2 replicas, Redis", "work", 5.0, 29.3, "flows_live --replicas 2"),
    LiveRow("2 replicas, Redis", "fifo", 7.3, 190.4, "flows_live --replicas 2"),
    LiveRow("2 replicas, Redis", "work", 5.2, 26.7, "flows_live --replicas 2 --modes fifo,work"),
    LiveRow("2 replicas, Redis", "fifo", 5.0, 83.0, "flows_live --replicas 2 --modes fifo,work"),
    LiveRow("2 replicas, Redis", "work", 5.6, 28.9, "flows_live --replicas 2 (the final tree)"),
    LiveRow("2 replicas, Redis", "fifo", 4.8, 77.1, "flows_live --replicas 2 (the final tree)"),
    # 2026-12-05, the simulated instances at llama-3.1-70b-8xh100's speed (prefill shares their steps):
    # flows_live --modes work+quiet,work,fifo --profile llama-3.1-70b-8xh100 [--workers 2 | --replicas 2]
    LiveRow("serve --workers 1, H100 speed", "work+quiet", 103.3, 103.6, "flows_live --profile ..."),
    LiveRow("serve --workers 1, H100 speed", "work", 106.7, 232.1, "flows_live --profile ..."),
    LiveRow("serve --workers 1, H100 speed", "fifo", 105.1, 1917.6, "flows_live --profile ..."),
    LiveRow("serve --workers 2, H100 speed", "work+quiet", 103.2, 103.2, "... --workers 2"),
    LiveRow("serve --workers 2, H100 speed", "work", 104.2, 889.7, "... --workers 2"),
    LiveRow("serve --workers 2, H100 speed", "fifo", 105.1, 1922.7, "... --workers 2"),
    LiveRow("2 replicas, Redis, H100 speed", "work+quiet", 103.3, 103.8, "... --replicas 2"),
    LiveRow("2 replicas, Redis, H100 speed", "work", 109.1, 1286.6, "... --replicas 2"),
    LiveRow("2 replicas, Redis, H100 speed", "fifo", 108.9, 2357.8, "... --replicas 2"),
)


def flows_spec(scale: Scale) -> FlowsSpec:
    """The evaluation's trace at ``scale``: the full one, or a few seconds of it (same rates)."""
    spec = FlowsSpec()
    if scale.fraction >= 1.0:
        return spec
    return msgspec.structs.replace(spec, duration_s=max(3.0, spec.duration_s * scale.fraction * 5))


def targets_table(report: Report) -> Table:
    """Per load and fairness mode: the four figures the issue sets targets for, and whether each is met."""
    rows = []
    for load, row in report["loads"].items():
        for mode, r in row["fairness"].items():
            worst = max(r["ttft_p99_vs_alone"].values())
            met = [
                worst <= TARGETS["ttft_p99_vs_alone"],
                r["high_p99_vs_no_batch"] <= TARGETS["high_p99_vs_no_batch"],
                r["jain_work"] >= TARGETS["jain_work"],
                r["throughput_vs_fifo"] >= TARGETS["throughput_vs_fifo"],
            ]
            rows.append(
                [
                    load,
                    mode,
                    worst,
                    r["high_p99_vs_no_batch"],
                    r["jain_work"],
                    r["throughput_vs_fifo"],
                    " ".join("met" if m else "-" for m in met),
                ]
            )
    return Table(
        ["load", "fairness", "p99 / alone", "high p99 / no batch", "Jain (work)", "throughput / fifo", "met"],
        ["str", "str", "x", "x", "x", "x", "str"],
        rows,
        title="Targets: p99/alone <= 1.2, high p99/no batch <= 1.05, Jain >= 0.95, throughput >= 0.98",
    )


def tenants_table(report: Report) -> Table:
    """Every tenant's TTFT p99 and refusals per load and fairness mode (the full trace)."""
    rows = []
    for load, row in report["loads"].items():
        for mode, r in row["fairness"].items():
            for tenant, t in r["full"]["tenants"].items():
                rows.append([load, mode, tenant, t["ttft_p50_s"], t["ttft_p99_s"], t["rejected"]])
    return Table(
        ["load", "fairness", "tenant", "TTFT p50", "TTFT p99", "refused"],
        ["str", "str", "str", "s", "s", "int"],
        rows,
        title="Every tenant, the full trace",
    )


def live_table(rows: tuple[LiveRow, ...] = LIVE) -> Table:
    return Table(
        ["setup", "fairness", "calm p90 alone", "under the flood", "ratio", "command"],
        ["str", "str", "str", "str", "x", "str"],
        [
            [
                r.setup,
                r.fairness,
                f"{r.alone_p90_ms:.1f} ms",
                f"{r.flood_p90_ms:.1f} ms",
                r.flood_p90_ms / r.alone_p90_ms,
                r.command,
            ]
            for r in rows
        ],
        title="Live: the calm tenant's p90 latency, alone and under a 32-client flood",
    )


def p99_bars(report: Report) -> Chart:
    """Per load: each interactive tenant's TTFT p99 over its p99 alone, one group of bars per mode, the
    1.2x target as a line."""
    loads = list(report["loads"])
    fig = Chart(figsize=(4.2 * len(loads), 3.2))
    for k, load in enumerate(loads):
        ax = fig.add_subplot(1, len(loads), k + 1)
        modes = list(report["loads"][load]["fairness"])
        tenants = sorted(report["loads"][load]["alone_ttft_p99_s"])
        width = 0.8 / max(1, len(tenants))
        for i, t in enumerate(tenants):
            vals = [report["loads"][load]["fairness"][m]["ttft_p99_vs_alone"][t] for m in modes]
            ax.bar(np.arange(len(modes)) + i * width, vals, width, label=t)
        ax.axhline(TARGETS["ttft_p99_vs_alone"], color="black", linestyle="--", linewidth=0.8)
        ax.set_xticks(np.arange(len(modes)) + width * (len(tenants) - 1) / 2, modes)
        ax.set_yscale("log")
        _plain_log(ax.yaxis)
        ax.set_title(f"load {load}")
        ax.set_ylabel("TTFT p99 / alone")
        if k == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
