"""Ports for test servers on 127.0.0.1."""

from __future__ import annotations

import random
import socket

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
