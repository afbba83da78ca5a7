"""A fleet verified before traffic: every instance reached, what it serves, whether it tokenizes as the
router does, whether its KV events arrive with the block size the fleet file says.

::

    per instance   GET /v1/models        served models, LoRA adapters, max_model_len; the file's ones served?
                   POST /tokenize        the parity probe set, ids against the router's own (Responses
                                         and Messages probes: their render routes, when served)
                   events                the file's endpoints, or GET /kv_event_sources; which side binds
                                         (vLLM's PUB binds a wildcard endpoint, connects out to a host):
                                         the live stream reached (a PUB handshake, or vLLM connecting to a
                                         SUB bound here), then a replay request (DEALER, from seq 0) or the
                                         live stream; the first stored batch's block size against the file's

Used by ``kvrouter check`` (a table, or JSON; non-zero exit on any failure) and by ``kvrouter serve`` at
start-up (logged).  An idle engine with no replay endpoint has sent nothing yet: a warning, not a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Literal

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from indexer.config import InstanceConfig
from indexer.errors import DecodeError
from indexer.subscriber import END_SEQ, replay_reply
from indexer.wire import BatchDecoder, offload_placeholders, stored_block_size

from ..config import RouterFleetConfig
from ..membership.errors import EventSourcesError
from ..membership.event_sources import with_event_sources
from ..pipeline import RequestPipeline
from .event_mode import pub_answers, pub_connects, settle_mode
from .parity_probe import ParityProber
from .upstream import UpstreamPool

Verdict = Literal["ok", "warn", "fail", "skip"]


class Check(msgspec.Struct):
    name: str
    """http, models, parity, events."""
    verdict: Verdict
    detail: str


class InstanceReport(msgspec.Struct):
    instance: str
    checks: list[Check]

    @property
    def failed(self) -> bool:
        return any(c.verdict == "fail" for c in self.checks)


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, bytes]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, await r.read()


async def check_models(
    session: aiohttp.ClientSession, inst: InstanceConfig, timeout_s: float
) -> tuple[Check, Check, list[str]]:
    """(http, models, served model ids)."""
    assert inst.url is not None
    try:
        status, body = await _get(session, inst.url.rstrip("/") + "/v1/models", timeout_s)
    except (aiohttp.ClientError, TimeoutError) as e:
        fail = Check("http", "fail", f"unreachable: {type(e).__name__}")
        return fail, Check("models", "skip", "not reached"), []
    if status != 200:
        return Check("http", "fail", f"/v1/models answered {status}"), Check("models", "skip", ""), []
    try:
        cards = msgspec.json.decode(body).get("data", [])
        ids = [c["id"] for c in cards]
    except (msgspec.DecodeError, AttributeError, KeyError, TypeError):
        return (
            Check("http", "fail", "/v1/models is not an OpenAI model list"),
            Check("models", "skip", ""),
            [],
        )
    base = [c["id"] for c in cards if not c.get("parent")]
    adapters = [c["id"] for c in cards if c.get("parent")]
    lens = sorted({c["max_model_len"] for c in cards if isinstance(c.get("max_model_len"), int)})
    detail = f"{', '.join(base)}" + (f"; LoRA: {', '.join(adapters)}" if adapters else "")
    detail += f"; max_model_len {'/'.join(map(str, lens))}" if lens else ""
    missing = [m for m in inst.models if m not in ids]
    models = (
        Check("models", "fail", f"does not serve {', '.join(missing)} (serves {detail})")
        if missing
        else Check("models", "ok", detail)
    )
    return Check("http", "ok", "reached"), models, ids


async def check_parity(prober: ParityProber, name: str) -> Check:
    detail = await prober.check_instance_detail(name, "startup")
    results = [r for _, r in detail]
    images = [r for route, r in detail if route.endswith("+image") and r not in ("skipped", "unsupported")]
    counted = [r for r in results if r not in ("skipped", "unsupported")]
    if not counted:
        return Check("parity", "skip", "no tokenizer for its models")
    bad = counted.count("mismatch")
    errors = counted.count("error")
    if bad:
        mm = next((m.last_mismatch for m in prober.tracker.models.values() if m.last_mismatch), None)
        at = f" (first at token {mm.position})" if mm is not None else ""
        return Check("parity", "fail", f"{bad} of {len(counted)} probes render other token ids{at}")
    if errors == len(counted):
        return Check("parity", "fail", "/tokenize did not answer")
    note = ""
    if images:
        note += f" (images: {images.count('match')}/{len(images)} match)"
    if "unsupported" in results:
        note = " (no render routes for responses/messages: checked by reported cached tokens)"
    return Check("parity", "ok", f"{len(counted) - errors}/{len(counted)} probes match{note}")


async def first_batches(
    ctx: zmq.asyncio.Context, inst: InstanceConfig, timeout_s: float, *, most: int = 64
) -> tuple[list[bytes], str]:
    """Payloads of rank 0's stream: up to ``most`` replayed from its buffer if it has a replay endpoint,
    else the next one published.  ([], why) when none came."""
    replay = inst.replay_endpoint(0)
    if replay is not None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        got: list[bytes] = []
        try:
            async with asyncio.timeout(timeout_s):
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                while len(got) < most:
                    reply = replay_reply(await dealer.recv_multipart())
                    if reply is None:
                        continue
                    seq, payload = reply
                    if seq == END_SEQ:
                        break
                    got.append(payload)
        except TimeoutError:
            if not got:
                return [], "replay endpoint did not answer"
        finally:
            dealer.close(linger=0)
        if not got:
            return [], "replay answered; the buffer holds no batch yet"
        return got, "replayed"
    events = inst.events_endpoint(0)
    assert events is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, inst.topic.encode())
    try:
        if inst.events_mode == "bind":
            sub.bind(events)
        else:
            sub.connect(events)
    except zmq.ZMQError as e:
        sub.close(linger=0)
        return [], f"cannot listen at {events}: {e}"
    try:
        async with asyncio.timeout(timeout_s):
            frames = await sub.recv_multipart()
            return [frames[-1]], "live"
    except TimeoutError:
        return [], "no batch published while we listened (an idle engine sends nothing)"
    finally:
        sub.close(linger=0)


async def _announced(
    session: aiohttp.ClientSession, inst: InstanceConfig, timeout_s: float
) -> tuple[InstanceConfig | None, Check | None]:
    """What the instance's ``/kv_event_sources`` announces (None if it has no such route), or the check
    that ends here when the file gives no events and the answer cannot stand in for them."""
    assert inst.url is not None
    given = inst.events is not None
    try:
        status, body = await _get(session, inst.url.rstrip("/") + "/kv_event_sources", timeout_s)
    except (aiohttp.ClientError, TimeoutError):
        return None, None if given else Check(
            "events", "fail", "no events given and /kv_event_sources unreachable"
        )
    if status != 200:
        return None, None if given else Check(
            "events", "warn", f"no events given and /kv_event_sources answered {status}"
        )
    try:
        return with_event_sources(inst, body), None
    except EventSourcesError as e:
        return None, None if given else Check("events", "warn", f"routed by load only: {e}")


async def live_stream(
    ctx: zmq.asyncio.Context, inst: InstanceConfig, timeout_s: float
) -> tuple[Verdict, str]:
    """Can this router receive rank 0's live stream?  A replay endpoint answering says nothing about it."""
    events = inst.events_endpoint(0)
    assert events is not None
    if inst.events_mode == "connect":
        if await pub_answers(ctx, events, timeout_s):
            return "ok", "live: a PUB answers"
        return "fail", f"live: no PUB answers at {events} (vLLM down, a firewall, or it connects out instead)"
    got = await pub_connects(ctx, events, timeout_s)
    if got is None:
        return "warn", f"live: cannot bind {events} here to listen (a running kvrouter serve holds it?)"
    if got:
        return "ok", "live: vLLM connected to our SUB"
    return "fail", f"live: vLLM did not connect to {events} in {timeout_s} s"


async def check_events(
    session: aiohttp.ClientSession,
    ctx: zmq.asyncio.Context,
    inst: InstanceConfig,
    block_size: int,
    timeout_s: float,
    *,
    held: set[str] | frozenset[str] = frozenset(),
) -> Check:
    if inst.events is None and inst.url is None:
        return Check("events", "skip", "no url and no events")
    announced, ended = (None, None) if inst.url is None else await _announced(session, inst, timeout_s)
    if ended is not None:
        return ended
    if inst.events is None:
        assert announced is not None
        try:
            if not (announced.events_mode == "bind" and announced.events in held):
                announced = await settle_mode(announced, ctx, timeout_s)
            inst = announced
        except EventSourcesError as e:
            return Check("events", "fail", str(e))
    elif announced is not None and announced.events_mode == "bind" and inst.events_mode == "connect":
        return Check(
            "events",
            "fail",
            f"{inst.events}: vLLM connects its PUB out to {announced.events} (its /kv_event_sources endpoint "
            "names a host), so a SUB connecting to it receives nothing. Fix: events_mode: bind for this "
            "instance with events at that address (it must be this router's), or start vLLM with a "
            "wildcard endpoint (tcp://*:PORT) so it binds",
        )
    mode = "router binds, vLLM connects" if inst.events_mode == "bind" else "router connects"
    where = f"{inst.events} x{inst.dp_size} ({mode})" + (f", replay {inst.replay}" if inst.replay else "")
    if inst.events_mode == "bind" and inst.events in held:
        live, live_detail = "ok", "live: bound by this router's subscriber"
    else:
        live, live_detail = await live_stream(ctx, inst, timeout_s)
    if live == "fail":
        return Check("events", "fail", f"{where}: {live_detail}")
    payloads, how = await first_batches(ctx, inst, timeout_s)
    if not payloads:
        verdict: Verdict = "fail" if how.startswith("replay endpoint") else "warn"
        return Check("events", verdict, f"{where}: {live_detail}; {how}")
    decoder, got, placeholders = BatchDecoder(), None, 0
    for payload in payloads:
        try:
            batch = decoder.decode(payload)
        except DecodeError as e:
            return Check("events", "fail", f"{where}: undecodable batch ({e.reason})")
        placeholders += offload_placeholders(batch)
        if got is None:
            got = stored_block_size(batch)
    if got is not None and got != block_size:
        return Check(
            "events", "fail", f"{where}: block size {got} on the engine, {block_size} in the fleet file"
        )
    seen = f"block size {got}" if got is not None else f"{len(payloads)} batches, no stored block in them"
    if placeholders:
        return Check(
            "events",
            "warn",
            f"{where}: {live_detail}; {seen} ({how}); {PLACEHOLDER_ADVICE.format(n=placeholders)}",
        )
    return Check("events", "warn" if live == "warn" else "ok", f"{where}: {live_detail}; {seen} ({how})")


PLACEHOLDER_ADVICE = (
    "{n} offload events without token ids (vLLM's OffloadingConnector announcing its CPU/storage copies "
    "as placeholders): they count only while the GPU copy is known, offloaded blocks that outlive it are "
    'lost to routing. Fix: add "self_describing_kv_events": true to kv_connector_extra_config '
    "(--kv-transfer-config)"
)


async def check_fleet(
    cfg: RouterFleetConfig,
    pipeline: RequestPipeline,
    session: aiohttp.ClientSession,
    *,
    timeout_s: float = 3.0,
    pool: UpstreamPool | None = None,
    parity: bool = True,
    held: set[str] | frozenset[str] = frozenset(),
) -> list[InstanceReport]:
    """Every instance of ``cfg`` checked, concurrently (``parity`` False: a running gateway's prober does
    that part; ``held``: endpoints the caller's own subscriber has bound, where vLLM connects to it)."""
    pool = pool or UpstreamPool(cfg.instances, pipeline.router.load)
    prober = ParityProber(pipeline, pool)
    prober.session = session
    ctx = zmq.asyncio.Context()

    # A few instances at a time: the parity probes tokenize on this process's event loop, and with
    # many at once the others' answers would wait behind them past their timeouts.
    gate = asyncio.Semaphore(4)

    async def one(inst: InstanceConfig) -> InstanceReport:
        async with gate:
            return await checked(inst)

    async def checked(inst: InstanceConfig) -> InstanceReport:
        checks: list[Check] = []
        if inst.url is None:
            checks.append(Check("http", "skip", "no url: events only"))
        else:
            http, models, ids = await check_models(session, inst, timeout_s)
            checks += [http, models]
            if http.verdict == "ok":
                u = pool.upstreams.get(inst.name)
                if u is not None and not u.cfg.models:
                    u.served_models = list(ids)
                if parity:
                    checks.append(await check_parity(prober, inst.name))
        checks.append(await check_events(session, ctx, inst, cfg.block_size, timeout_s, held=held))
        return InstanceReport(inst.name, checks)

    try:
        return list(await asyncio.gather(*(one(i) for i in cfg.instances)))
    finally:
        with contextlib.suppress(zmq.ZMQError):
            ctx.destroy(linger=0)  # never blocks, even on a socket a cancelled check left open


def table(reports: list[InstanceReport]) -> str:
    rows = [("instance", "check", "verdict", "detail")]
    for r in reports:
        for c in r.checks:
            rows.append((r.instance, c.name, c.verdict.upper(), c.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(v.ljust(widths[i]) if i < 3 else v for i, v in enumerate(row)) for row in rows)


def as_json(reports: list[InstanceReport]) -> dict[str, Any]:
    return {
        "ok": not any(r.failed for r in reports),
        "instances": {r.instance: msgspec.to_builtins(r.checks) for r in reports},
    }
