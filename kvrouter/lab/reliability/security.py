"""Security checks beyond tenant isolation: logs never carry event or request contents, and the admin
and OpenAI routes can be locked.

::

    log hygiene    every logger at DEBUG, records formatted as the CLI does (JSON with every extra field)
                   while a fleet publishes events carrying a secret salt and marker token ids, corrupt
                   batches, a crash, bad requests ──▶ no record holds the salt, the marker ids or the prompt
                   + a static scan: no logging call in the indexer, gateway or replicas passes a name that
                   holds contents (payload, frames, token_ids, body, prompt, messages, salt, ...)
    access         admin routes: no token / a wrong token / a tenant's key / path variants ──▶ 401 or 404
                   OpenAI routes with require_api_key: no key, unknown key, the admin token ──▶ 401
"""

from __future__ import annotations

import ast
import logging
import random
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_least, exactly
from kvrouter.lab.reliability.stack import MODEL, Resources, client, completion, set_faults, subscribed, until
from kvrouter.logs import JsonFormatter

_CONTENT_NAMES = frozenset(
    {"payload", "frames", "token_ids", "tokens", "events", "body", "raw", "prompt", "messages", "salt"}
    | {"cache_salt", "data", "chunk", "text", "extra_keys"}
)
"""Variables that hold event or request contents: none may reach a logging call (``len()`` of one may)."""
_CONTENT_ATTRS = frozenset({"payload", "token_ids", "extra_keys", "cache_salt", "prompt", "messages", "body"})
"""Attributes that hold contents (``ev.token_ids``, ``req.body``); ``inst.events`` is an endpoint."""
_LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical", "log"})
_SCANNED = ("indexer", "kvrouter/gateway", "kvrouter/replicas", "kvrouter/membership")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("kvrouter.lab.sim"):
            return  # the simulated vLLM is not kvrouter
        self.lines.append(self.format(record))


@contextmanager
def capture_logs() -> Iterator[_Capture]:
    """Every record of every logger at DEBUG, formatted with all its extra fields."""
    root = logging.getLogger()
    handler = _Capture()
    old = root.level
    # The handlers already there (the CLI's stderr) keep showing only what they showed before.
    others = [(h, h.level) for h in root.handlers]
    for h, level in others:
        h.setLevel(max(level, old))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old)
        for h, level in others:
            h.setLevel(level)


def scan_log_calls(root: Path) -> list[str]:
    """Logging calls in the scanned packages whose arguments name contents (``file:line name``)."""
    found: list[str] = []
    for pkg in _SCANNED:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _LOG_METHODS
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("log", "logger", "logging")
                ):
                    continue
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    found.extend(f"{path.relative_to(root)}:{node.lineno} {n}" for n in _content_refs(arg))
    return found


def _content_refs(node: ast.AST) -> list[str]:
    """Content-bearing names under ``node``, not counting those only measured with ``len()``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
        return []
    if isinstance(node, ast.Name) and node.id in _CONTENT_NAMES:
        return [node.id]
    if isinstance(node, ast.Attribute) and node.attr in _CONTENT_ATTRS:
        return [node.attr]
    return [n for child in ast.iter_child_nodes(node) for n in _content_refs(child)]


async def log_hygiene(res: Resources, seed: int = 0) -> ScenarioResult:
    t_start = time.perf_counter()
    salt = f"SALT{secrets.token_hex(12)}"
    marker = [54321 + i for i in range(40)]  # ids above any port number in use here
    word = f"zq{secrets.token_hex(6)}"
    rng = random.Random(seed)
    fleet = res.fleet(2, seed=seed)
    with capture_logs() as cap:
        async with fleet:
            g = await res.gateway(fleet)
            async with g, client() as s:
                await until(lambda: subscribed(g), 10, "subscribed")
                for i in range(6):
                    await completion(s, g.base, [*marker, i], cache_salt=salt, max_tokens=3)
                    await completion(s, g.base, f"{word} {word} tell me {i}", cache_salt=salt, max_tokens=3)
                for srv in fleet.servers:  # undecodable batches on the live stream
                    await set_faults(s, srv.url, corrupt_next=2)
                for i in range(4):  # fresh blocks on every instance, so batches (the corrupt ones) go out
                    fresh = [*marker, *(rng.randrange(100, 30_000) for _ in range(48))]
                    await completion(s, fleet.servers[i % 2].url, fresh, cache_salt=salt, max_tokens=2)
                    await completion(s, g.base, [*fresh, 1], cache_salt=salt, max_tokens=2)
                async with s.post(
                    f"{g.base}/v1/completions", data=b'{"prompt": [54321, "x"], "cache_salt": '
                ) as r:
                    await r.read()
                await completion(s, g.base, [*marker, 7], cache_salt=salt, model="no-such-model")
                await set_faults(s, fleet.servers[0].url, crash=True, down_s=0.2)
                await completion(s, g.base, [*marker, 8], cache_salt=salt, max_tokens=2)
                await until(lambda: not fleet.servers[0].instance.faults.crashed, 5, "restart")
                await completion(s, g.base, [*marker, 9], cache_salt=salt, max_tokens=2)
                ix = g.gateway.indexer
                decode_errors = sum(ix.counters.decode_errors.values())
    pattern = re.compile(r"54321\D{1,4}54322")
    leaks = [ln for ln in cap.lines if salt in ln or word in ln or pattern.search(ln)]
    root = Path(__file__).resolve().parents[3]
    static = scan_log_calls(root)
    figures: list[Figure] = [
        at_least("log records captured at DEBUG", len(cap.lines), 10, fmt="{:.0f}"),
        at_least("undecodable batches ingested meanwhile", decode_errors, 1, fmt="{:.0f}"),
        exactly("records holding the salt, marker token ids or prompt text", len(leaks), 0),
        exactly("logging calls passing content-bearing names (static scan)", len(static), 0),
    ]
    return ScenarioResult(
        "log-hygiene",
        "Security",
        "Logs never carry event or request contents",
        figures,
        time.perf_counter() - t_start,
        notes=[*leaks[:3], *static[:5]],
    )


class _Check(msgspec.Struct):
    what: str
    status: int
    ok: bool


async def access_control(res: Resources, seed: int = 0) -> ScenarioResult:
    t_start = time.perf_counter()
    admin = secrets.token_hex(16)
    key = f"sk-{secrets.token_hex(8)}"
    over = {
        "gateway": {"admin_token": admin},
        "tenants": {"require_api_key": True, "api_keys": {key: {"name": "a", "salt": secrets.token_hex(8)}}},
    }
    checks: list[_Check] = []
    fleet = res.fleet(2, seed=seed)
    async with fleet:
        g = await res.gateway(fleet, over)
        async with g, client() as s:

            async def check(what: str, method: str, path: str, allowed: set[int], token: str | None) -> None:
                headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
                async with s.request(method, f"{g.base}{path}", json=body, headers=headers) as r:
                    await r.read()
                    checks.append(_Check(what, r.status, r.status in allowed))

            for path, method in (
                ("/v1/route/explain", "POST"),
                ("/v1/cache/lookup", "POST"),
                ("/v1/fleet", "GET"),
            ):
                await check(f"{path} without a token", method, path, {401}, None)
                await check(f"{path} with a wrong token", method, path, {401}, admin[:-1] + "x")
                await check(f"{path} with a tenant's API key", method, path, {401}, key)
                await check(f"{path} with the admin token", method, path, {200}, admin)
            for variant in (
                "/v1/fleet/",
                "/v1//fleet",
                "/V1/fleet",
                "/v1/fleet?x=1",
                "/v1/%66leet",
                "/./v1/fleet",
            ):
                await check(f"{variant} without a token", "GET", variant, {401, 404}, None)
            for path in ("/v1/completions", "/invocations"):
                await check(f"{path} without a key", "POST", path, {401}, None)
                await check(f"{path} with an unknown key", "POST", path, {401}, "sk-nobody")
                await check(f"{path} with the admin token", "POST", path, {401}, admin)
                await check(f"{path} with a tenant's key", "POST", path, {200}, key)
    bad = [c for c in checks if not c.ok]
    figures = [
        exactly(
            f"admin and OpenAI route checks answered as locked (of {len(checks)})",
            len(checks) - len(bad),
            len(checks),
        ),
        Figure("open without a token (by design)", "/health, /livez, /ping, /metrics, /v1/models", ""),
    ]
    return ScenarioResult(
        "access",
        "Security",
        "Admin token and API keys",
        figures,
        time.perf_counter() - t_start,
        notes=[f"{c.what}: {c.status}" for c in bad],
    )
