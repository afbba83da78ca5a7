"""Shared fixtures.  Everything binds to 127.0.0.1."""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import Iterator

import pytest

_rng = random.Random()


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+).  A ZeroMQ socket reconnecting to a closed port
    in the ephemeral range can connect to itself (TCP self-connect) and squat the port; these cannot."""
    for _ in range(200):
        p = _rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return p
    raise RuntimeError("no free port")


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
