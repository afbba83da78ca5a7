"""A multimodal agent workload: computer-use sessions resending their screenshots, and questions on
documents whose figures many users share.

::

    agent turn k:  [tools][task][shot 0]([action j][result j+1][shot j+1]) for j < k    (one session)
    document QA:   [system][section 1][figure 1] ... [section m][figure m][question]    (doc d, Zipf)

An image is a run of placeholder tokens (the same stream for every image, as vLLM's pad tokens are) and
a ``MediaItem`` naming it: two images at the same place differ only by their identifiers, which vLLM keys
into the blocks they overlap and the router mixes into its block hashes the same way.  Turn k's ``action
k`` is its ``output_segments`` and each turn ``depends_on`` the previous one, sent ``response_time_s +
think`` after it in open loop.  Placeholder counts are Qwen2.5-VL's (``tokenizer_cache.mm.processors``:
a 1280 x 720 screenshot is 1196 tokens, an 800 x 600 figure 609); docs/multimodal.md, "In the evaluation".
"""

from __future__ import annotations

import numpy as np

from kvrouter.lab.workloads.arrivals import Arrival, Poisson, arrival_times
from kvrouter.lab.workloads.build import GeneratorParams, Keys, assemble, rng_for
from kvrouter.lab.workloads.spec import ClosedLoop, MediaItem, Request, Segment, Workload

_Part = tuple[Segment, str | None]
"""A prompt part: its tokens, and the identifier of the image they are the placeholders of (or None)."""


class MultimodalAgentParams(GeneratorParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Computer-use agent sessions and document questions, sharing a fleet."""

    num_sessions: int = 60
    """Agent sessions; each sends ``turns`` requests."""
    turns: int = 8
    """Steps per session (turn k carries k + 1 screenshots)."""
    session_arrival: Arrival = Poisson(0.4)
    """When sessions start."""
    tools_len: int = 2000
    """Tokens of the agent's system prompt and tool definitions (one application: shared)."""
    task_len: int = 150
    """Tokens of each session's task."""
    screenshot_tokens: int = 1196
    """Placeholder tokens per screenshot (1280 x 720 on Qwen2.5-VL)."""
    action_len: int = 60
    """Tokens of each answer (the action the agent takes)."""
    result_len: int = 80
    """Tokens of each tool result sent with the next screenshot."""
    think_time_s: float = 2.0
    """Mean time (exponential) the action takes before the next turn is sent."""
    response_time_s: float = 4.0
    """Open loop only: how long a turn is assumed to take before its action runs."""
    affinity: bool = True
    """Send the session id as affinity id (``prompt_cache_key``)."""
    num_documents: int = 30
    """Documents with figures."""
    sections: int = 4
    """Sections per document, each followed by one figure."""
    section_len: int = 700
    """Tokens of each section's text."""
    figure_tokens: int = 609
    """Placeholder tokens per figure (800 x 600 on Qwen2.5-VL)."""
    doc_system_len: int = 200
    """Tokens of the document assistant's system prompt (shared)."""
    num_questions: int = 600
    """Questions on documents (one request each)."""
    question_arrival: Arrival = Poisson(3.0)
    """When questions arrive."""
    zipf_s: float = 1.0
    """Document popularity: rank r is asked about with weight ``r ** -zipf_s``."""
    question_len: int = 60
    """Tokens of each (unique) question."""
    answer_len: int = 150
    """Tokens of each answer to a question."""

    def __post_init__(self) -> None:
        if self.form != "tokens":
            raise ValueError("multimodal-agent is tokens form only (images have no text rendering)")
        if self.num_requests is not None:
            raise ValueError("multimodal-agent is sized by num_sessions x turns and num_questions")
        if min(self.num_sessions, self.num_questions, self.num_documents) < 0 or self.turns < 1:
            raise ValueError("counts must be >= 0 and turns >= 1")
        if self.num_questions and (self.num_documents < 1 or self.sections < 0):
            raise ValueError("questions need at least one document")
        lengths = (
            self.tools_len,
            self.task_len,
            self.result_len,
            self.section_len,
            self.doc_system_len,
            self.question_len,
        )
        if min(lengths) < 0 or min(self.screenshot_tokens, self.figure_tokens) < 1:
            raise ValueError("lengths must be >= 0 and images at least one token")
        if min(self.action_len, self.answer_len) < 1 or self.zipf_s < 0:
            raise ValueError("outputs must be >= 1 token and zipf_s >= 0")
        if self.think_time_s < 0 or self.response_time_s < 0:
            raise ValueError("think_time_s and response_time_s must be >= 0")
        if isinstance(self.session_arrival, ClosedLoop) or isinstance(self.question_arrival, ClosedLoop):
            raise ValueError("multimodal-agent is open loop: sessions and questions arrive on a schedule")


def _fields(parts: list[_Part]) -> dict[str, object]:
    """Segments, items and length of a prompt made of ``parts``."""
    items: list[MediaItem] = []
    at = 0
    for seg, ident in parts:
        if ident is not None:
            items.append(MediaItem(ident, at, seg.length))
        at += seg.length
    return {"segments": tuple(s for s, _ in parts), "items": tuple(items), "num_prompt_tokens": at}


def _identifier(keys: Keys, *labels: str | int) -> str:
    """An item identifier shaped like vLLM's (a hex digest of the image's bytes)."""
    return f"{keys('image', *labels):016x}"


def _times(arrival: Arrival, n: int, params: MultimodalAgentParams, stream: str) -> list[float]:
    return [float(t) for t in arrival_times(arrival, n, rng_for(params, stream)) or ()]


def multimodal_agent(name: str, params: MultimodalAgentParams) -> Workload:
    """Build the sessions' turns and the document questions, in arrival order."""
    keys = Keys(params.seed, name)
    pad = keys("placeholder")
    requests = _sessions(name, params, keys, pad) + _questions(name, params, keys, pad)
    return assemble(name, params, requests)


def _sessions(name: str, params: MultimodalAgentParams, keys: Keys, pad: int) -> list[Request]:
    starts = _times(params.session_arrival, params.num_sessions, params, "sessions")
    thinks = rng_for(params, "think").exponential(params.think_time_s, (len(starts), params.turns))
    tools = keys.segment(params.tools_len, "tools")
    out: list[Request] = []
    for c, start in enumerate(starts):
        session = f"{name}-s{c:04d}"
        history: list[_Part] = [(tools, None), (keys.segment(params.task_len, "task", c), None)]
        t, previous = start, None
        for k in range(params.turns):
            if k:
                history.append((keys.segment(params.result_len, "result", c, k), None))
            history.append((Segment(pad, params.screenshot_tokens), _identifier(keys, "shot", c, k)))
            action = keys.segment(params.action_len, "action", c, k)
            think = float(thinks[c, k]) if k else 0.0
            if k:
                t += params.response_time_s + think
            rid = f"{session}-t{k:02d}"
            out.append(
                Request(
                    id=rid,
                    arrival_s=t,
                    max_output_tokens=params.action_len,
                    output_segments=(action,),
                    session_id=session,
                    turn=k,
                    depends_on=previous,
                    think_s=think,
                    affinity_id=session if params.affinity else None,
                    group="agent",
                    **_fields(history),  # type: ignore[arg-type]
                )
            )
            history.append((action, None))
            previous = rid
    return out


def _questions(name: str, params: MultimodalAgentParams, keys: Keys, pad: int) -> list[Request]:
    n_docs = params.num_documents
    if not params.num_questions:
        return []
    rng = rng_for(params, "documents")
    weights = np.arange(1, n_docs + 1, dtype=float) ** -params.zipf_s
    docs = rng.choice(n_docs, size=params.num_questions, p=weights / weights.sum()).tolist()
    system = keys.segment(params.doc_system_len, "doc-system")
    out: list[Request] = []
    for i, t in enumerate(_times(params.question_arrival, params.num_questions, params, "questions")):
        d = docs[i]
        parts: list[_Part] = [(system, None)]
        for s in range(params.sections):
            parts.append((keys.segment(params.section_len, "section", d, s), None))
            parts.append((Segment(pad, params.figure_tokens), _identifier(keys, "figure", d, s)))
        parts.append((keys.segment(params.question_len, "question", i), None))
        out.append(
            Request(
                id=f"{name}-q{i:05d}",
                arrival_s=t,
                max_output_tokens=params.answer_len,
                group=f"doc{d:03d}",
                **_fields(parts),  # type: ignore[arg-type]
            )
        )
    return out
