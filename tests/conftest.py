"""Shared fixtures.  Everything binds to 127.0.0.1."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.support.net import free_port

# Property tests check behaviour, not speed: a shared 2-core machine stalls a single example for a second
# now and then, which Hypothesis's default 200 ms deadline reports as a failure.  Speed is the benchmarks'.
settings.register_profile("kvrouter", deadline=None)
settings.load_profile("kvrouter")


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
