"""Which side of an instance's KV-event stream binds, found on the wire.

vLLM's PUB binds on a wildcard or ipc endpoint and connects out to an endpoint naming a host
(``membership.event_sources.publisher_binds``).  What that means for this router is a fact about sockets,
so it is settled with sockets::

    events_mode bind (vLLM connects out to tcp://H:P)
      H:P can be bound here ───────────────▶ bind a SUB there (the address is ours; vLLM will connect)
      a PUB answers a handshake at H:P ────▶ connect after all (vLLM bound it: tcp://*:0 announced as IP)
      H:P held here by something else ─────▶ EventSourcesError taken  (another router holds it?)
      neither ────────────────────────────▶ EventSourcesError elsewhere, with the fix spelled out

``pub_answers`` (a PUB completes a ZMTP handshake with our SUB) and ``pub_connects`` (a PUB connects to a
SUB we bind) are also what ``kvrouter check`` uses to tell a live stream it can receive from one it cannot:
a replay endpoint answering proves nothing about the PUB.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Literal

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.config import InstanceConfig

from ..membership.errors import EventSourcesError
from ..membership.event_sources import connect_fix

BindProbe = Literal["free", "taken", "foreign"]


def tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


def bind_probe(host: str, port: int) -> BindProbe:
    """Can a listening socket be bound at (host, port) here?  ``foreign``: the address is not this host's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "taken"
            return "foreign"
        except socket.gaierror:
            return "foreign"
        return "free"


async def _handshake(ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float, *, bind: bool) -> bool | None:
    """A SUB at ``endpoint`` (connected, or bound): True once a peer completes the ZMTP handshake (only a
    PUB/XPUB can, with a SUB), False if none did in ``timeout_s``, None if ``bind`` failed."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 100)
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        if bind:
            try:
                sub.bind(endpoint)
            except zmq.ZMQError:
                return None
        else:
            sub.connect(endpoint)
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    msg = parse_monitor_message(await mon.recv_multipart())
                    if msg.get("event") == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        return True
        except TimeoutError:
            return False
    finally:
        sub.disable_monitor()
        mon.close(linger=0)
        sub.close(linger=0)


async def pub_answers(ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float) -> bool:
    """Does a bound PUB answer at ``endpoint`` (a SUB connecting there would receive)?"""
    return bool(await _handshake(ctx, endpoint, timeout_s, bind=False))


async def pub_connects(ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float) -> bool | None:
    """Does a PUB connect to a SUB bound here at ``endpoint``?  None: it cannot be bound here."""
    return await _handshake(ctx, endpoint, timeout_s, bind=True)


async def settle_mode(
    inst: InstanceConfig, ctx: zmq.asyncio.Context, timeout_s: float = 1.0
) -> InstanceConfig:
    """``inst`` with an ``events_mode`` the router can carry out (see the module's diagram); raises
    ``EventSourcesError`` (``taken``, ``elsewhere``) when it cannot receive the stream at all."""
    if inst.events_mode != "bind" or inst.events is None:
        return inst
    hp = tcp_host_port(inst.events)
    if hp is None:  # ipc: vLLM would have bound it; nothing to probe
        return inst
    probe = bind_probe(*hp)
    if probe == "free":
        return inst
    if await pub_answers(ctx, inst.events, timeout_s):
        return msgspec.structs.replace(inst, events_mode="connect")
    if probe == "taken":
        raise EventSourcesError(
            "taken",
            f"{inst.name}: vLLM connects its KV-event PUB out to {inst.events}, an address of this host, "
            "but another process holds it (another kvrouter serve, or another worker of this one: only "
            "one process can bind there; run --workers 1, or give vLLM a wildcard endpoint so it binds)",
        )
    raise EventSourcesError("elsewhere", connect_fix(inst.name, inst.events))
