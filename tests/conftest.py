"""Shared fixtures.  Everything binds to 127.0.0.1."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.net import free_port

# Property tests check behaviour, not speed: a shared 2-core machine stalls a single example for a second
# now and then, which Hypothesis's default 200 ms deadline reports as a failure.  Speed is the benchmarks'.
settings.register_profile("kvrouter", deadline=None)
# CI (``.ci/run`` sets KVROUTER_HYPOTHESIS=ci) draws the same examples on every run, so a submission's
# verdict does not depend on the luck of the draw; developers' runs (and ``make fuzz``, with more examples)
# draw fresh ones and are where new counterexamples are found.
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("fuzz", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("KVROUTER_HYPOTHESIS", "kvrouter"))

# Parallel workers (pytest-xdist: gw0, gw1, ...) each look for free ports in a slice of their own
# (``kvrouter.lab.sim.server.fleet.port_range``; what they start inherits it): two workers finding the
# same port free at once, one then binding it, failed a test with "Address already in use".
_worker, _workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
if _worker.startswith("gw") and _worker[2:].isdigit() and _workers.isdigit() and int(_workers) > 1:
    _i, _n = int(_worker[2:]), int(_workers)
    _w = (32000 - 20000) // _n
    os.environ["KVROUTER_PORT_RANGE"] = f"{20000 + _i * _w}-{20000 + (_i + 1) * _w}"


ROOT = Path(__file__).resolve().parents[1]

E2E = (
    "tests/kvrouter/epp/test_envoy.py",
    "tests/kvrouter/epp/test_pool_envoy.py",
    "tests/kvrouter/host/test_serve_workers.py",
    "tests/kvrouter/host/test_agreement_workers.py",
    "tests/kvrouter/host/test_metrics_workers.py",
    "tests/kvrouter/commands/test_serve_workers_default.py",
    "tests/kvrouter/lab/reliability/test_command.py",
    "tests/kvrouter/lab/sim/server/test_cli.py",
    "tests/kvrouter/lab/report/test_notebooks.py",
)
"""Tests that start process trees (Envoy, ``kvrouter serve --workers``, the CLI, notebook kernels): marked
``e2e``, run by ``make e2e`` as a step of their own after the unit step (both are part of ``make test``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(ROOT).as_posix() in E2E:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """Tests that run the CLI install its stderr handler on pytest's captured stream, which is closed after
    the test: restore the root logger so later tests' records (and tracebacks) still reach pytest."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
