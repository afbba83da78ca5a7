"""Fleet-file reload: a changed file's instances are applied, an invalid or missing one keeps the old
membership (counted once), other sections are reported as needing a restart."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import yaml

from indexer.config import InstanceConfig
from kvrouter.config import RouterFleetConfig, load_router_fleet
from kvrouter.membership import FleetFileWatcher, Reconciler
from tests.support.membership import FakeMembership
from tests.support.wait import until


def write(path: Path, instances: list[dict[str, object]], **extra: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"block_size": 16, "instances": instances, **extra}))
    os.replace(tmp, path)  # as editors and ConfigMap updates do: readers never see half a file


def entry(name: str, port: int = 8000) -> dict[str, object]:
    return {"name": name, "url": f"http://{name}:{port}", "events": f"tcp://{name}:5557"}


def setup(
    tmp_path: Path, instances: list[dict[str, object]]
) -> tuple[Path, FakeMembership, Reconciler, FleetFileWatcher]:
    path = tmp_path / "fleet.yaml"
    write(path, instances)
    cfg = load_router_fleet(path)
    m = FakeMembership()
    r = Reconciler(m, initial=cfg.instances, poll_s=0.005)
    return path, m, r, FleetFileWatcher(path, r, cfg, load=load_router_fleet, interval_s=0.02)


async def test_an_unchanged_file_applies_nothing(tmp_path: Path) -> None:
    _, m, r, w = setup(tmp_path, [entry("a")])
    assert w.poll()  # the first read parses (it may differ from what the process started with)
    assert not w.poll()
    await r.settle()
    assert m.calls == [] and w.counters["reloads"] == 1


async def test_adds_and_removes_are_applied_while_running(tmp_path: Path) -> None:
    path, m, r, w = setup(tmp_path, [entry("a"), entry("b")])
    w.start()
    try:
        write(path, [entry("b"), entry("c")])
        await asyncio.wait_for(until(lambda: sorted(r.applied) == ["b", "c"] and not r.busy()), 60.0)
        assert ("add", "c") in m.calls and ("remove", "a") in m.calls and ("drain", "a") in m.calls
        write(path, [entry("b", port=9000), entry("c")])
        # b is changed by a removal then an addition: absent from ``applied`` in between
        want_b = InstanceConfig("b", "http://b:9000", "tcp://b:5557")
        await asyncio.wait_for(until(lambda: r.applied.get("b") == want_b and not r.busy()), 60.0)
        assert m.calls[-3:] == [("drain", "b"), ("remove", "b"), ("add", "b")]
        assert w.config.instances == [want_b, r.applied["c"]]
    finally:
        await w.stop()
        await r.stop()


async def test_an_invalid_file_keeps_the_old_membership(tmp_path: Path) -> None:
    path, m, r, w = setup(tmp_path, [entry("a")])
    assert w.poll()
    good = w.config
    for bad in (
        "instances: [{name: a}, {name: a}]\n",  # duplicate names
        "instances: [{name: x, url: ftp://x}]\n",  # fails validate()
        "instances: [{name: x, dp_size: many}]\n",  # wrong type
        "routing: {policy: nope}\n",  # unknown policy
        "instances: [\n",  # not YAML
        "surprise: 1\n",  # unknown section
    ):
        path.write_text(bad)
        assert not w.poll() and not w.poll()  # counted once per bad version
        assert w.last_error is not None and w.last_error.reason == "invalid"
        assert w.config is good and not r.busy() and m.calls == []
    assert w.counters["errors_invalid"] == 6
    write(path, [entry("a"), entry("z")])
    assert w.poll() and w.last_error is None
    await r.settle()
    assert m.calls == [("add", "z")]


async def test_a_missing_file_keeps_the_old_membership(tmp_path: Path) -> None:
    path, m, r, w = setup(tmp_path, [entry("a")])
    path.unlink()
    assert not w.poll() and not w.poll()
    assert w.counters["errors_unreadable"] == 1 and w.last_error is not None
    write(path, [entry("a")])
    assert w.poll() and w.last_error is None
    await r.settle()
    assert m.calls == [] and sorted(r.applied) == ["a"]


async def test_other_sections_need_a_restart(tmp_path: Path) -> None:
    path, m, r, w = setup(tmp_path, [entry("a")])
    seen: list[tuple[RouterFleetConfig, list[str]]] = []
    w.on_config = lambda cfg, pending: seen.append((cfg, pending))
    write(path, [entry("a")], routing={"policy": "round-robin"}, limits={"queue_size": 3})
    assert w.poll()
    assert w.pending_restart == ["limits", "routing"] or w.pending_restart == ["routing", "limits"]
    assert seen[-1][0].routing.policy == "round-robin" and set(seen[-1][1]) == {"routing", "limits"}
    write(path, [entry("a")])  # back as it was running: nothing pending
    assert w.poll() and w.pending_restart == []
    await r.settle()
    assert m.calls == []
