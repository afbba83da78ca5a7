"""Usage blocks: the simulator writes them, everyone else reads ``cached_tokens`` from them.

``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``) is how many
prompt tokens the engine served from its prefix cache: the ground truth the router's predictions are held
to.  It arrives in a unary body, or in the last chunk of a stream with ``stream_options.include_usage``.
"""

from __future__ import annotations

from typing import Any

import msgspec


class UsageReport(msgspec.Struct, frozen=True):
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """None when the engine did not report it (prompt-token details off)."""
    completion_tokens: int | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """A usage block as vLLM writes it (cached tokens included)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def read_usage(answer: object) -> UsageReport | None:
    """The usage block of a decoded answer (a body or a chunk), or None if it has none."""
    u = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return UsageReport(_int(u.get("prompt_tokens")), cached, _int(u.get("completion_tokens")))


class UsageWatcher:
    """Finds the usage block in a response passing through, streamed (SSE) or not, without holding it.

    Only the bytes around a possible usage block are decoded: a stream's chunks are scanned for
    ``"usage"``, and at most one partial event is kept between chunks."""

    def __init__(self) -> None:
        self._tail = b""
        self.report: UsageReport | None = None

    @property
    def cached_tokens(self) -> int | None:
        return self.report.cached_tokens if self.report is not None else None

    def feed_stream(self, chunk: bytes) -> None:
        data = self._tail + chunk
        if b"cached_tokens" not in data and b'"usage"' not in data:
            self._tail = data[-64:]
            return
        *events, self._tail = data.split(b"\n\n")
        for ev in events:
            if b'"usage"' in ev and ev.startswith(b"data: {"):
                self._read(ev[6:])

    def feed_body(self, body: bytes) -> None:
        if b'"usage"' in body:
            self._read(body)

    def _read(self, js: bytes) -> None:
        try:
            obj = msgspec.json.decode(js)
        except msgspec.DecodeError:
            return
        got = read_usage(obj)
        if got is not None:
            self.report = got
