"""``settle_mode``: which side binds an instance's KV-event stream, found with real sockets on 127.0.0.1."""

from __future__ import annotations

import socket

import pytest
import zmq
import zmq.asyncio

from indexer.config import InstanceConfig
from kvrouter.gateway.event_mode import bind_probe, pub_answers, settle_mode
from kvrouter.membership.errors import EventSourcesError
from tests.support.net import free_port


def inst(port: int) -> InstanceConfig:
    return InstanceConfig(
        "v0", url="http://127.0.0.1:1", events=f"tcp://127.0.0.1:{port}", events_mode="bind"
    )


async def test_a_free_address_of_ours_is_bound_by_the_router() -> None:
    port = free_port()
    assert bind_probe("127.0.0.1", port) == "free"
    ctx = zmq.asyncio.Context()
    try:
        assert (await settle_mode(inst(port), ctx)).events_mode == "bind"
    finally:
        ctx.destroy(linger=0)


async def test_a_pub_already_bound_there_is_connected_to() -> None:
    """``tcp://*:0`` announced as the node's address reads like connect mode; a PUB answering says not."""
    port = free_port()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        assert bind_probe("127.0.0.1", port) == "taken"
        assert await pub_answers(ctx, f"tcp://127.0.0.1:{port}", 2.0)
        assert (await settle_mode(inst(port), ctx, 2.0)).events_mode == "connect"
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_an_address_held_by_something_else_is_refused_with_the_reason() -> None:
    port = free_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(EventSourcesError) as e:
            await settle_mode(inst(port), ctx, 0.5)
        assert e.value.reason == "taken" and "another process holds it" in str(e.value)
    finally:
        holder.close()
        ctx.destroy(linger=0)
