"""Usage blocks: the simulator writes them, everyone else reads ``cached_tokens`` from them.

``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``) is how many
prompt tokens the engine served from its prefix cache: the ground truth the router's predictions are held
to.  It arrives in a unary body, or in the last chunk of a stream with ``stream_options.include_usage``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from .responses import completed_output, response_id_of

_RESP = b'"object":"response"'


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
    """The usage block of a decoded answer (a body or a chunk), or None if it has none.

    Three shapes: chat and completions (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``), the
    Responses API (``input_tokens``, ``input_tokens_details.cached_tokens``; in a stream, inside the
    event's ``response``) and Anthropic Messages (``input_tokens`` not counting ``cache_read_input_tokens``;
    in ``message_start``, inside its ``message``)."""
    if not isinstance(answer, dict):
        return None
    u = answer.get("usage")
    if u is None:
        inner = answer.get("response") or answer.get("message")
        u = inner.get("usage") if isinstance(inner, dict) else None
    if not isinstance(u, dict):
        return None
    if "prompt_tokens" in u:
        details = u.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        return UsageReport(_int(u.get("prompt_tokens")), cached, _int(u.get("completion_tokens")))
    if "input_tokens" not in u:
        return None
    details = u.get("input_tokens_details")
    prompt, output = _int(u.get("input_tokens")), _int(u.get("output_tokens"))
    if isinstance(details, dict):
        return UsageReport(prompt, _int(details.get("cached_tokens")), output)
    cached = _int(u.get("cache_read_input_tokens"))
    created = _int(u.get("cache_creation_input_tokens")) or 0
    total = None if prompt is None else prompt + (cached or 0) + created
    return UsageReport(total, cached, output)


class UsageWatcher:
    """Finds the usage block in a response passing through, streamed (SSE) or not, without holding it;
    with ``on_id``, also the id of a Responses API response (reported once, as soon as it is seen).

    Only the bytes around a possible usage block (or response object) are decoded: a stream's chunks are
    scanned for ``"usage"``, and at most one partial event is kept between chunks."""

    def __init__(
        self,
        on_id: Callable[[str], None] | None = None,
        on_output: Callable[[str, list[dict[str, Any]]], None] | None = None,
    ) -> None:
        self._tail = b""
        self.report: UsageReport | None = None
        self._on_id = on_id
        self._on_output = on_output
        """Told a finished response's id and output items, once (they come with its usage)."""
        self.response_id: str | None = None

    @property
    def cached_tokens(self) -> int | None:
        return self.report.cached_tokens if self.report is not None else None

    def _wanted(self, data: bytes) -> bool:
        return b'"usage"' in data or (self._on_id is not None and self.response_id is None and _RESP in data)

    def feed_stream(self, chunk: bytes) -> None:
        data = self._tail + chunk
        if not self._wanted(data):
            self._tail = data[-64:]
            return
        *events, self._tail = data.split(b"\n\n")
        for ev in events:
            if not self._wanted(ev):
                continue
            # ``data: {...}``, after an ``event: <type>`` line in the Responses and Messages streams
            start = ev.find(b"data: {")
            if start == 0 or (start > 0 and ev[start - 1 : start] == b"\n"):
                self._read(ev[start + 6 :])

    def feed_body(self, body: bytes) -> None:
        if self._wanted(body):
            self._read(body)

    def _read(self, js: bytes) -> None:
        try:
            obj = msgspec.json.decode(js)
        except msgspec.DecodeError:
            return
        rid = response_id_of(obj) if self._on_id is not None or self._on_output is not None else None
        if self._on_id is not None and self.response_id is None and rid is not None:
            self.response_id = rid
            self._on_id(rid)
        got = read_usage(obj)
        if got is not None:
            self.report = got
        if self._on_output is not None:
            out = completed_output(obj)
            if out is not None and rid is not None:
                self._on_output(rid, out)
                self._on_output = None
