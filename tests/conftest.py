"""Shared fixtures.  Everything binds to 127.0.0.1."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.support.net import free_port


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
