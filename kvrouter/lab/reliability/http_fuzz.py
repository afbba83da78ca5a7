"""Fuzzing the HTTP APIs with hypothesis: malformed JSON, wrong types, huge bodies, unknown models, invalid
``cache_salt``: always a 4xx with a reason (or a 200), never a 5xx, never a stuck connection.

::

    hypothesis (a worker thread, sync http.client)          this event loop
      @given(target, body, content type) ─────HTTP────▶  gateway   /v1/completions /v1/chat/completions
                                                                   /invocations /v1/route/explain
                                                                   /v1/cache/lookup
                                                         indexer   /v1/cache/lookup  (standalone app)
      per answer: status < 500, a non-empty reason on 4xx, an answer within the timeout

Properties are recorded, not asserted inside the test function, so one run measures everything (no
shrinking); the figures and the tests then hold the counts to zero.  Both apps run with a small body
limit (``limits.max_body_bytes`` / the indexer's ``max_body_bytes``) so huge bodies are cheap to send.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections import Counter
from typing import Any

import msgspec
from aiohttp import web

from indexer import Indexer
from indexer.service import make_indexer_app
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, exactly, fig
from kvrouter.lab.reliability.stack import MODEL, Resources, free_port

GATEWAY_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/invocations",
    "/v1/route/explain",
    "/v1/cache/lookup",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/tokenize",
)


class HttpFuzzConfig(msgspec.Struct, frozen=True):
    examples: int = 3000
    seed: int = 0
    max_body_bytes: int = 64 << 10
    timeout_s: float = 15.0
    """An answer slower than this is a stuck connection."""


class Target(msgspec.Struct, frozen=True):
    name: str
    port: int
    path: str


class FuzzStats(msgspec.Struct):
    sent: int = 0
    statuses: Counter[int] = msgspec.field(default_factory=Counter)
    server_errors: list[str] = []
    stuck: list[str] = []
    no_reason: list[str] = []
    json_reasons: int = 0
    too_large: int = 0
    unknown_model: int = 0
    bad_salt: int = 0
    max_s: float = 0.0


def _send(t: Target, body: bytes, ctype: str | None, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=timeout)
    try:
        headers = {"Content-Length": str(len(body))}
        if ctype is not None:
            headers["Content-Type"] = ctype
        conn.request("POST", t.path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _reason(data: bytes) -> tuple[bool, bool]:
    """(has a reason, is a JSON ``{"error": {"message": ...}}``)."""
    try:
        obj = json.loads(data)
    except ValueError:
        return bool(data.strip()), False
    err = obj.get("error") if isinstance(obj, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    return (isinstance(msg, str) and bool(msg)) or bool(data.strip()), isinstance(msg, str) and bool(msg)


def run_hypothesis(targets: list[Target], cfg: HttpFuzzConfig) -> FuzzStats:
    """The hypothesis run (blocking: call it from a worker thread while the servers run on the loop)."""
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st

    stats = FuzzStats()
    leaf = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=24)
    )
    anyjson = st.recursive(
        leaf,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=12,
    )
    tokens = st.lists(st.integers(min_value=-3, max_value=2**33), max_size=64)
    fields: dict[str, Any] = {
        "model": st.sampled_from([MODEL, "nope", "", "SIM-MODEL", "sim-model\x00"]) | anyjson,
        "prompt": st.text(max_size=120)
        | tokens
        | st.lists(st.text(max_size=16), max_size=3)
        | st.lists(tokens, max_size=2)
        | anyjson,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "tool", "nobody"]) | anyjson},
                optional={"content": st.text(max_size=60) | anyjson, "name": anyjson},
            ),
            max_size=3,
        )
        | anyjson,
        "token_ids": tokens | anyjson,
        "stream": st.booleans() | anyjson,
        "max_tokens": st.integers(min_value=-2, max_value=6) | anyjson,
        "n": st.integers(min_value=-1, max_value=2) | anyjson,
        "cache_salt": st.text(max_size=12) | anyjson,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | anyjson}) | anyjson,
        "prompt_cache_key": st.text(max_size=12) | anyjson,
        "lora_name": st.text(max_size=12) | anyjson,
        "tools": anyjson,
        "input": st.text(max_size=60)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["message", "function_call", "reasoning", "function_call_output"])},
                optional={"role": st.sampled_from(["user", "assistant"]) | anyjson, "content": anyjson},
            )
            | anyjson,
            max_size=3,
        )
        | anyjson,
        "instructions": st.text(max_size=30) | anyjson,
        "previous_response_id": st.text(max_size=12) | anyjson,
        "system": st.text(max_size=30) | anyjson,
        "thinking": anyjson,
        "chat_template_kwargs": anyjson,
        "add_generation_prompt": anyjson,
    }
    shaped = st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps(d).encode())
    raw = (
        st.binary(max_size=160)
        | anyjson.map(lambda v: json.dumps(v).encode())
        | shaped.flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda k: b[:k]))  # truncated
        | shaped.map(lambda b: b.replace(b'"', b"\xff", 1))  # invalid UTF-8
        | st.just(b'{"model": "sim-model", "prompt": "' + b"a" * (cfg.max_body_bytes + 16) + b'"}')  # 413
        | st.just(b'{"model": "sim-model", "prompt": "x", "cache_salt": ""}')
        | st.just(b'{"model": "sim-model", "prompt": "x", "cache_salt": 7}')
        | st.just(b'{"model": "no-such-model", "prompt": "x"}')
    )
    # Mostly valid requests with a few fields of any type, so the deeper paths (tokenizing, templates,
    # routing, proxying) see odd values too, not only the body checks.
    ok_prompt = st.text(max_size=80) | st.lists(
        st.integers(min_value=1, max_value=30_000), min_size=1, max_size=64
    )
    ok_messages = st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=60)}),
        min_size=1,
        max_size=3,
    )
    extras = st.dictionaries(st.sampled_from(sorted(fields)), anyjson, max_size=2)
    base = st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(min_value=1, max_value=4)},
        optional={"stream": st.booleans(), "cache_salt": st.text(min_size=1, max_size=8)},
    )
    completion = st.tuples(base, ok_prompt, extras).map(lambda t: {**t[0], "prompt": t[1], **t[2]})
    chat = st.tuples(base, ok_messages, extras).map(lambda t: {**t[0], "messages": t[1], **t[2]})
    valid = (completion | chat).map(lambda d: json.dumps(d).encode())
    body = valid | valid | shaped | raw
    ctype = st.sampled_from(["application/json", "application/json", "text/plain", None])

    @seed(cfg.seed)
    @settings(
        max_examples=cfg.examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.sampled_from(targets), body, ctype)
    def probe(t: Target, data: bytes, content_type: str | None) -> None:
        stats.sent += 1
        what = f"{t.name} {t.path} {data[:400]!r}"
        t0 = time.monotonic()
        try:
            status, answer = _send(t, data, content_type, cfg.timeout_s)
        except TimeoutError:
            stats.stuck.append(what)
            return
        except (ConnectionError, http.client.HTTPException) as e:
            # A server may close after refusing a body it will not read (413): the refusal was sent.
            if len(data) <= cfg.max_body_bytes:
                stats.stuck.append(f"{what}: {type(e).__name__}")
            else:
                stats.too_large += 1
            return
        stats.max_s = max(stats.max_s, time.monotonic() - t0)
        stats.statuses[status] += 1
        if status >= 500:
            stats.server_errors.append(f"{what} -> {status} {answer[:120]!r}")
        elif status >= 400:
            has, is_json = _reason(answer)
            stats.json_reasons += is_json
            if not has:
                stats.no_reason.append(f"{what} -> {status}")
            stats.too_large += status == 413
            stats.unknown_model += status == 404 and b"not served" in answer
            stats.bad_salt += status == 400 and b"cache_salt" in answer

    probe()
    return stats


async def http_fuzz(res: Resources, cfg: HttpFuzzConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    fleet = res.fleet(2, seed=cfg.seed)
    async with fleet:
        g = await res.gateway(fleet, {"limits": {"max_body_bytes": cfg.max_body_bytes}})
        async with g:
            tokens = await res.tokens(g.cfg)
            ix_app = make_indexer_app(Indexer(16), None, encoder=tokens, max_body_bytes=cfg.max_body_bytes)
            runner = web.AppRunner(ix_app, access_log=None)
            await runner.setup()
            ix_port = free_port()
            await web.TCPSite(runner, "127.0.0.1", ix_port).start()
            try:
                targets = [Target("gateway", g.port, p) for p in GATEWAY_PATHS]
                targets.append(Target("indexer", ix_port, "/v1/cache/lookup"))
                stats = await asyncio.to_thread(run_hypothesis, targets, cfg)
            finally:
                await runner.cleanup()
    figures: list[Figure] = [
        fig("requests (hypothesis, gateway + standalone indexer)", stats.sent, fmt="{:,}"),
        exactly("5xx answers", len(stats.server_errors), 0),
        exactly("stuck or cut connections (body under the limit)", len(stats.stuck), 0),
        exactly("4xx without a reason", len(stats.no_reason), 0),
        fig("answers by status", dict(stats.statuses)),
        fig(
            "413 (body over the limit) / 404 unknown model / 400 bad cache_salt",
            f"{stats.too_large} / {stats.unknown_model} / {stats.bad_salt}",
        ),
        fig("slowest answer", stats.max_s, fmt="{:.2f} s"),
    ]
    return ScenarioResult(
        "http-fuzz",
        "Bad input",
        f"HTTP API fuzz (hypothesis), {stats.sent:,} requests",
        figures,
        time.perf_counter() - t_start,
        notes=[*stats.server_errors[:3], *stats.stuck[:3], *stats.no_reason[:3]],
    )
