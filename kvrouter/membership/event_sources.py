"""An instance's KV-event publishers, as vLLM 0.33 announces them on ``GET /kv_event_sources``.

vLLM answers with its publisher config per data-parallel rank, the ports already offset by the rank::

    {"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
           "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000,
           "max_queue_size": 100000, "topic": ""},
     "1": {... "endpoint": "tcp://*:5558", ...}}

``*`` (and ``0.0.0.0``, ``::``) means "this host": the router subscribes on the host of the instance's
URL.  An empty answer (a render-only server) or events disabled means the instance publishes nothing.
So a fleet file (or Kubernetes discovery) need give an instance only its URL.  Pure: the gateway's
``EventSourceResolver`` does the HTTP.

The answer names no mode, but vLLM's publisher decides by the endpoint's text (``ZmqEventPublisher.
_is_bind_endpoint``, the same in 0.32 and 0.33): it **binds** its PUB when the endpoint holds ``*`` or
``::`` or is ``ipc://``/``inproc://``, and otherwise **connects out** to that address, expecting a bound
SUB there.  So an endpoint naming a host (``tcp://10.0.0.5:5557``) gives ``events_mode: bind``: the router
must bind a SUB at that very address, which works only if it is the router's own (``settle_mode`` in the
shell finds out).  One case reads like connect mode and is not: ``tcp://*:0`` is bound on the node's IP
and announced as ``tcp://<ip>:<port>``; the shell tells it apart by finding the port already listening.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

from indexer.config import InstanceConfig, offset_endpoint

from .errors import EventSourcesError

_ANY_HOST = ("*", "0.0.0.0", "::", "[::]")


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: does a publisher configured with ``endpoint`` bind its PUB (else it connects out)?"""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connect_fix(inst: str, endpoint: str) -> str:
    """What to change when ``inst``'s vLLM connects out to an address this router cannot bind."""
    port = endpoint.rpartition(":")[2]
    return (
        f"{inst}: vLLM connects its KV-event PUB out to {endpoint} (an endpoint naming a host makes it "
        f"connect, not bind) and no SUB of this router can be bound there, so no event would arrive. Fix: "
        f'start vLLM with --kv-events-config \'{{..., "endpoint": "tcp://*:{port}"}}\' (it binds; the '
        f"router connects), or point its endpoint at an address of this router's host"
    )


class EventSource(msgspec.Struct, frozen=True):
    """One rank's ``KVEventsConfig`` (fields a router reads; the others are ignored)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""


_decode = msgspec.json.Decoder(dict[str, EventSource])


def _on_host(endpoint: str, host: str) -> str:
    """``endpoint`` with an any-host address replaced by ``host`` (tcp only; ipc stays as it is)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    addr, _, port = endpoint[len("tcp://") :].rpartition(":")
    if addr in _ANY_HOST or not addr:
        addr = f"[{host}]" if ":" in host else host
    return f"tcp://{addr}:{port}"


def with_event_sources(inst: InstanceConfig, answer: bytes) -> InstanceConfig:
    """``inst`` with the events, replay endpoint, topic and ranks its ``/kv_event_sources`` announced.

    Raises ``EventSourcesError``: ``invalid`` (not the expected JSON), ``disabled`` (no rank publishes
    over ZeroMQ), ``ranks`` (ranks not numbered 0..n-1, or ports that do not follow vLLM's rank offset,
    which the fleet file's single endpoint per instance cannot express)."""
    if inst.url is None:
        raise EventSourcesError("invalid", f"{inst.name} has no url")
    try:
        ranks = _decode.decode(answer)
    except msgspec.DecodeError as e:
        raise EventSourcesError("invalid", str(e)) from None
    by_rank: dict[int, EventSource] = {}
    for k, v in ranks.items():
        if not k.isdigit():
            raise EventSourcesError("invalid", f"rank {k!r} is not a number")
        by_rank[int(k)] = v
    live = {r: s for r, s in by_rank.items() if s.enable_kv_cache_events and s.publisher == "zmq"}
    if not live:
        raise EventSourcesError("disabled", f"{inst.name} publishes no KV events")
    if sorted(live) != list(range(len(live))):
        raise EventSourcesError("ranks", f"{inst.name}: ranks {sorted(live)} are not 0..{len(live) - 1}")
    host = urlsplit(inst.url).hostname or ""
    first = live[0]
    binds = publisher_binds(first.endpoint)
    if any(publisher_binds(s.endpoint) != binds for s in live.values()):
        raise EventSourcesError("ranks", f"{inst.name}: some ranks bind their publisher, others connect")
    events = _on_host(first.endpoint, host)
    replay = _on_host(first.replay_endpoint, host) if first.replay_endpoint else None
    for r, s in live.items():
        if _on_host(s.endpoint, host) != offset_endpoint(events, r) or (
            replay is not None
            and s.replay_endpoint
            and _on_host(s.replay_endpoint, host) != offset_endpoint(replay, r)
        ):
            raise EventSourcesError(
                "ranks", f"{inst.name}: rank {r}'s endpoints do not follow the rank offset"
            )
    return msgspec.structs.replace(
        inst,
        events=events,
        events_mode="connect" if binds else "bind",
        replay=replay,
        topic=first.topic,
        dp_size=len(live),
    )
