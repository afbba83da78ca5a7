"""Ports for test servers on 127.0.0.1."""

from __future__ import annotations

import random
import socket
from collections import deque

from kvrouter.lab.sim.server.fleet import port_range

_rng = random.Random()


_given: deque[int] = deque(maxlen=512)
"""Ports this process handed out lately: two asked for in a row before either is bound differ."""


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+).  A ZeroMQ socket reconnecting to a closed port
    in the ephemeral range can connect to itself (TCP self-connect) and squat the port; these cannot.
    Within this test worker's slice of the range (``port_range``), so parallel workers never race."""
    lo, hi = port_range()
    for _ in range(200):
        p = _rng.randrange(lo, hi)
        if p in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            _given.append(p)
            return p
    raise RuntimeError("no free port")
