"""Token parity: are the token ids the router computes the ones the fleet computes?  Pure state; the
gateway's ``ParityProber`` asks the instances.

Every routing prediction stands on parity: a template rendered differently from vLLM's gives other ids,
so predicted hits that do not exist.  Checks come from a probe set per model at start-up, a sample of
live requests (``parity.sample_rate``), a shortfall (vLLM reported a block or more fewer cached tokens
than predicted), and rechecks while a model fails.  Chat, completions and pooling are compared through
``POST /tokenize``; responses and messages through vLLM's render routes with the body as sent (only with
``--enable-scale-out``; otherwise "unsupported", and reported cached tokens are compared with the
prediction instead, ``cached_tokens_check``).

Per model: unknown -> ok on a match; ok -> failing on a mismatch; failing -> ok when every probe of a
recheck matches.  While a model fails, ``trusted(model)`` is False: the pipeline routes it without
token-based predictions (by prefix text and load); other models are not affected.  A mismatch is logged
with the first differing position, never the content.
"""

from __future__ import annotations

import enum
import random
from collections import Counter, deque
from typing import Any, Literal

import msgspec

from indexer.hashing import TokenIds, id_list

from ..api.requests import ParsedRequest
from ..config import ParityConfig

Reason = Literal["startup", "sample", "shortfall", "recheck"]

# Chat fields that change what vLLM renders but that /tokenize cannot carry: a request using them is
# not probed (its render cannot be checked field for field).
_UNPROBEABLE = ("documents", "reasoning_effort", "tool_choice", "chat_template", "mm_processor_kwargs")


class ParityStatus(enum.StrEnum):
    UNKNOWN = "unknown"
    OK = "ok"
    FAILING = "failing"


class ProbeCase(msgspec.Struct):
    """One check: what to send to the instance (``path``: /tokenize or a render route) and the ids the
    router computed for it."""

    model: str | None
    body: dict[str, Any]
    ours: list[int]
    reason: Reason
    instance: str | None = None
    """Ask this instance (the one the request went to); None: any healthy instance serving the model."""
    path: str = "/tokenize"
    route: str = "chat"
    """The request's kind (chat, completions, pooling, responses, messages): the metric's label."""


class Mismatch(msgspec.Struct):
    position: int
    """The first index where the ids differ (the shorter length if one is a prefix of the other)."""
    ours: int
    theirs: int
    """Lengths."""
    instance: str
    reason: str


class ModelParity(msgspec.Struct):
    status: ParityStatus = ParityStatus.UNKNOWN
    checks: dict[str, int] = {}
    """By result: match, mismatch, error."""
    last_mismatch: Mismatch | None = None
    failing_since: float | None = None
    recheck_pass: int = 0
    """Matches in a row since the model failed (a recheck passes when its whole probe set matched)."""


RENDER_PATHS = {"responses": "/v1/responses/render", "messages": "/v1/messages/render"}


def probe_request(req: ParsedRequest) -> tuple[str, dict[str, Any]] | None:
    """Where to ask an instance for ``req``'s ids and what to send: ``/tokenize`` for chat, completions
    and pooling text; the render route of a Responses or Messages request with the body as the client
    sent it (never the router's own conversion: that would check the conversion against itself).  None
    when nothing can express it (a continued Responses conversation, count_tokens, other routes)."""
    if req.kind in RENDER_PATHS:
        if req.kind == "responses" and req.previous_response_id is not None:
            return None
        return RENDER_PATHS[req.kind], {**req.body, "model": req.model}
    body = tokenize_body(req)
    return None if body is None else ("/tokenize", body)


def tokenize_body(req: ParsedRequest) -> dict[str, Any] | None:
    """The ``/tokenize`` request that renders ``req`` exactly as its own route does, or None when
    /tokenize cannot express it (token-id prompts need no check; some chat fields have no equivalent;
    Responses and Messages shapes: see ``probe_request``)."""
    if req.kind not in ("chat", "completions", "pooling"):
        return None
    b = req.body
    messages = req.messages
    if isinstance(messages, list):
        if any(b.get(k) is not None for k in _UNPROBEABLE):
            return None
        out: dict[str, Any] = {"model": req.model, "messages": messages}
        for k in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
            if b.get(k) is not None:
                out[k] = b[k]
        out["add_special_tokens"] = b.get("add_special_tokens") is True
        return out
    if isinstance(req.prompt, str) and req.kind in ("completions", "pooling"):
        return {
            "model": req.model,
            "prompt": req.prompt,
            "add_special_tokens": b.get("add_special_tokens", True),
        }
    return None


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where two id lists differ (None when equal)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


class ParityTracker:
    """Per-model parity state and the checks waiting to be made (an outbox the prober drains)."""

    def __init__(self, cfg: ParityConfig, *, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.models: dict[str | None, ModelParity] = {}
        self.pending: deque[ProbeCase] = deque()
        self.dropped = 0
        self.skipped: Counter[str] = Counter()
        """Sampled requests not checked, by reason (unprobeable, untokenized)."""
        self.render_unavailable: set[str] = set()
        """Routes (responses, messages) whose render route some instance does not serve: their answers'
        cached tokens are compared with the predictions instead."""
        self._rng = rng or random.Random()

    def of(self, model: str | None) -> ModelParity:
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = ModelParity(checks={})
        return m

    def trusted(self, model: str | None) -> bool:
        """Token-based predictions may be used for ``model`` (unknown counts as trusted: parity is
        assumed until a check says otherwise)."""
        m = self.models.get(model)
        return m is None or m.status != ParityStatus.FAILING

    def enqueue(self, case: ProbeCase) -> None:
        if len(self.pending) >= self.cfg.queue:
            self.dropped += 1
            return
        self.pending.append(case)

    def take(self) -> list[ProbeCase]:
        out = list(self.pending)
        self.pending.clear()
        return out

    def routed(self, req: ParsedRequest, ours: TokenIds | None, instance: str) -> None:
        """A request was routed with token ids ``ours``: sample it for a check."""
        if not self.cfg.enabled or self.cfg.sample_rate <= 0 or self._rng.random() >= self.cfg.sample_rate:
            return
        self._check_request(req, ours, instance, "sample")

    def shortfall(
        self,
        req: ParsedRequest,
        ours: TokenIds | None,
        instance: str,
        predicted: int,
        reported: int,
        block_size: int,
    ) -> None:
        """vLLM reported ``reported`` cached tokens where ``predicted`` were expected."""
        if self.cfg.enabled and predicted - reported >= self.cfg.shortfall_blocks * block_size:
            self._check_request(req, ours, instance, "shortfall")

    def _check_request(
        self, req: ParsedRequest, ours: TokenIds | None, instance: str, reason: Reason
    ) -> None:
        probe = probe_request(req)
        if probe is None or ours is None:
            self.skipped["unprobeable" if ours is not None else "untokenized"] += 1
            return
        path, body = probe
        self.enqueue(ProbeCase(req.model, body, id_list(ours), reason, instance, path, req.kind))

    def cached_tokens_check(
        self, req: ParsedRequest, ours: TokenIds | None, predicted: int, reported: int, block_size: int
    ) -> str | None:
        """The parity evidence of a Responses or Messages answer whose render route the fleet does not
        serve: vLLM found at least the predicted cached blocks ("match"), or ``shortfall_blocks`` blocks
        fewer ("shortfall": counted, not failing the model, since an eviction the router has not heard of
        yet looks the same).  None when there is nothing to compare (no prediction of a whole block)."""
        if not self.cfg.enabled or req.kind not in RENDER_PATHS or ours is None or predicted < block_size:
            return None
        if reported >= predicted:
            result = "match"
        elif predicted - reported >= self.cfg.shortfall_blocks * block_size:
            result = "shortfall"
        else:
            return None
        m = self.of(req.model)
        key = f"cached_tokens_{result}"
        m.checks[key] = m.checks.get(key, 0) + 1
        return result

    def unsupported(self, case: ProbeCase) -> None:
        """The instance does not serve ``case.path`` (a render route without --enable-scale-out)."""
        self.skipped[f"{case.route}_render_unavailable"] += 1
        self.render_unavailable.add(case.route)

    def record(self, case: ProbeCase, theirs: list[int] | None, instance: str, now: float) -> str:
        """The fleet's answer to ``case`` (None: the call failed).  Returns the result: match, mismatch
        or error; a mismatch fails the model, a recheck whose probes all matched restores it."""
        m = self.of(case.model)
        if theirs is None:
            result = "error"
        else:
            pos = first_difference(case.ours, theirs)
            if pos is None:
                result = "match"
                if m.status == ParityStatus.FAILING:
                    m.recheck_pass += 1
                else:
                    m.status = ParityStatus.OK
            else:
                result = "mismatch"
                m.last_mismatch = Mismatch(pos, len(case.ours), len(theirs), instance, case.reason)
                if m.status != ParityStatus.FAILING:
                    m.failing_since = now
                m.status = ParityStatus.FAILING
                m.recheck_pass = 0
        m.checks[result] = m.checks.get(result, 0) + 1
        return result

    def recheck_done(self, model: str | None, probes: int) -> None:
        """A recheck of ``model``'s ``probes`` probes ended: if every one matched, parity is back."""
        m = self.of(model)
        if m.status == ParityStatus.FAILING and probes and m.recheck_pass >= probes:
            m.status = ParityStatus.OK
            m.failing_since = None
        m.recheck_pass = 0

    def failing(self) -> list[str | None]:
        return [k for k, v in self.models.items() if v.status == ParityStatus.FAILING]

    def state(self) -> dict[str, Any]:
        """For /health and /v1/fleet: the verdict per model, its counts and its last mismatch."""
        return {
            "models": {str(k): msgspec.to_builtins(v) for k, v in self.models.items()},
            "dropped": self.dropped,
            "skipped": dict(self.skipped),
        }
