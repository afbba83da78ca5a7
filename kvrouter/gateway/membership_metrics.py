"""Prometheus exposition of membership, read from the runtime's counters at scrape time.

::

    kvrouter_membership_instances{state=desired|applied|draining}       gauge
    kvrouter_membership_steps{op=added|updated|removed|undrained}        counter
    kvrouter_membership_drain_timeouts                                   counter
    kvrouter_membership_errors{source=reconcile|fleet_file|discovery, reason}  counter
    kvrouter_membership_fleet_file_reloads                               counter
    kvrouter_membership_restart_pending{section}                         gauge (1 per changed section)
    kvrouter_membership_discovery_synced                                 gauge
    kvrouter_membership_discovery_{lists,relists,watches,gone}           counter
    kvrouter_membership_discovery_events{type}                           counter
    kvrouter_membership_discovery_skipped{reason}                        gauge (endpoints left out now)

Register with ``registry.register(MembershipCollector(runtime))``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .membership_runtime import MembershipRuntime

_P = "kvrouter_membership"
_STEPS = ("added", "updated", "removed", "undrained")


def _prefixed(c: Counter[str], prefix: str) -> list[tuple[str, int]]:
    return sorted((k[len(prefix) :], v) for k, v in c.items() if k.startswith(prefix))


class MembershipCollector(Collector):
    def __init__(self, runtime: MembershipRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        r = self.runtime.reconciler
        inst = GaugeMetricFamily(f"{_P}_instances", "Instances by membership state", labels=["state"])
        for state, n in (
            ("desired", len(r.desired)),
            ("applied", len(r.applied)),
            ("draining", len(r.draining)),
        ):
            inst.add_metric([state], n)
        yield inst
        steps = CounterMetricFamily(f"{_P}_steps", "Membership steps applied", labels=["op"])
        for op in _STEPS:
            steps.add_metric([op], r.counters[op])
        yield steps
        yield CounterMetricFamily(
            f"{_P}_drain_timeouts",
            "Instances dropped with requests still in flight",
            value=r.counters["drain_timeouts"],
        )
        errors = CounterMetricFamily(
            f"{_P}_errors", "Membership errors by source and reason", labels=["source", "reason"]
        )
        for reason, n in _prefixed(r.counters, "errors_"):
            errors.add_metric(["reconcile", reason], n)
        errors.add_metric(["reconcile", "source_conflict"], r.counters["source_conflicts"])
        w = self.runtime.watcher
        if w is not None:
            for reason, n in _prefixed(w.counters, "errors_"):
                errors.add_metric(["fleet_file", reason], n)
            yield CounterMetricFamily(
                f"{_P}_fleet_file_reloads", "Valid fleet-file versions applied", value=w.counters["reloads"]
            )
            pending = GaugeMetricFamily(
                f"{_P}_restart_pending", "Changed fleet-file sections awaiting a restart", labels=["section"]
            )
            for section in w.pending_restart:
                pending.add_metric([section], 1)
            yield pending
        d = self.runtime.discovery
        if d is not None:
            for reason, n in _prefixed(d.counters, "errors_"):
                errors.add_metric(["discovery", reason], n)
            yield GaugeMetricFamily(
                f"{_P}_discovery_synced", "1 once the first LIST is applied", value=int(d.synced.is_set())
            )
            for name in ("lists", "relists", "watches", "gone"):
                yield CounterMetricFamily(
                    f"{_P}_discovery_{name}", f"Discovery {name}", value=d.counters[name]
                )
            events = CounterMetricFamily(f"{_P}_discovery_events", "Watch events by type", labels=["type"])
            for kind, n in _prefixed(d.counters, "events_"):
                events.add_metric([kind], n)
            yield events
            skipped = GaugeMetricFamily(
                f"{_P}_discovery_skipped", "Ready endpoints left out, by reason", labels=["reason"]
            )
            for reason, n in sorted(d.skipped.items()):
                skipped.add_metric([reason], n)
            yield skipped
        yield errors
