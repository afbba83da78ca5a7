"""Chat workloads: multi-turn conversations that grow turn by turn, and short single-turn chats.

Multi-turn: turn ``k`` of a conversation resends the whole history, including the previous answers::

    turn 0:  [system][user 0]
    turn 1:  [system][user 0][assistant 0][user 1]
    turn 2:  [system][user 0][assistant 0][user 1][assistant 1][user 2]

``assistant k`` is turn k's ``output_segments``: an engine model that generates exactly those tokens caches
the decode blocks that turn k+1 then hits, as a real vLLM does with its own output.  Each later turn
``depends_on`` the previous one; open loop sends it ``response_time_s + think`` after the previous turn's
arrival (``think`` exponential), closed loop after the previous turn has finished plus ``think_s``.

Short chat (ShareGPT-like): one turn, log-normal prompt and output lengths, and nothing shared but a short
chat-template header: the case where AWS saw only -13..16 % median TTFT from prefix-aware routing.
"""

from __future__ import annotations

import numpy as np

from kvrouter.lab.workloads.arrivals import Arrival, Poisson
from kvrouter.lab.workloads.build import GeneratorParams, Keys, Renderer, assemble, rng_for, schedule
from kvrouter.lab.workloads.spec import Request, Role, Segment, Workload


class MultiTurnParams(GeneratorParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Multi-turn chat: 1000-token system prompt, 200-token user turns, 200-token answers."""

    num_conversations: int = 200
    """Conversations (sessions); the request count is ``num_conversations * turns``."""
    turns: int = 5
    """User turns per conversation."""
    system_len: int = 1000
    """Tokens of the system prompt."""
    shared_system: bool = True
    """One system prompt for every conversation (one application); False: one per conversation."""
    turn_len: int = 200
    """Tokens of each user turn."""
    output_len: int = 200
    """Tokens of each answer."""
    think_time_s: float = 10.0
    """Mean user think time (exponential) between an answer and the next turn."""
    response_time_s: float = 8.0
    """Open loop only: how long a turn is assumed to take before its answer is read."""
    affinity: bool = True
    """Send the session id as affinity id (``prompt_cache_key`` / SageMaker Prefix-Aware-Id)."""
    arrival: Arrival = Poisson(0.5)
    """When conversations start (their first turns); later turns follow their previous one."""

    def __post_init__(self) -> None:
        if self.num_requests is not None:
            raise ValueError("multi-turn workloads are sized by num_conversations x turns")
        if self.num_conversations < 0 or self.turns < 1:
            raise ValueError("num_conversations must be >= 0 and turns >= 1")
        if min(self.system_len, self.turn_len, self.output_len) < 0 or self.output_len < 1:
            raise ValueError("lengths must be >= 0 (output_len >= 1)")
        if self.think_time_s < 0 or self.response_time_s < 0:
            raise ValueError("think_time_s and response_time_s must be >= 0")


def multi_turn(name: str, params: MultiTurnParams) -> Workload:
    """Build conversations; open loop sorted by time, closed loop conversation by conversation."""
    starts = schedule(params, params.num_conversations)
    rng = rng_for(params, "think")
    keys = Keys(params.seed, name)
    render = Renderer(params.form)
    # Think times drawn up front, row by row (scale 0 gives zeros): adding conversations leaves the
    # earlier ones' think times unchanged.
    thinks = rng.exponential(params.think_time_s, (len(starts), params.turns))
    requests: list[Request] = []
    for c, start in enumerate(starts):
        session = f"{name}-c{c:05d}"
        system = keys.segment(params.system_len, "system", 0 if params.shared_system else c)
        history: list[tuple[Role, Segment]] = [("system", system)]
        t = start
        previous: str | None = None
        for k in range(params.turns):
            history.append(("user", keys.segment(params.turn_len, "user", c, k)))
            answer = keys.segment(params.output_len, "assistant", c, k)
            think = float(thinks[c, k]) if k else 0.0
            if k and t is not None:
                t += params.response_time_s + think
            rid = f"{session}-t{k:02d}"
            requests.append(
                Request(
                    id=rid,
                    arrival_s=t,
                    max_output_tokens=params.output_len,
                    output_segments=render.outputs((answer,)),
                    session_id=session,
                    turn=k,
                    depends_on=previous,
                    think_s=think,
                    affinity_id=session if params.affinity else None,
                    group=session,
                    **render.fields(history),
                )
            )
            history.append(("assistant", answer))
            previous = rid
    return assemble(name, params, requests)


class ShortChatParams(GeneratorParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """ShareGPT-like single-turn chats: short prompts, little sharing."""

    header_len: int = 32
    """Tokens of the chat-template header every prompt starts with (the only shared part)."""
    prompt_len_median: float = 180.0
    """Median user prompt tokens (log-normal)."""
    prompt_len_sigma: float = 1.0
    """Sigma of the log-normal prompt length."""
    prompt_len_max: int = 4096
    """Prompt lengths are clipped to ``[4, prompt_len_max]``."""
    output_len_median: float = 200.0
    """Median output tokens (log-normal)."""
    output_len_sigma: float = 0.8
    """Sigma of the log-normal output length."""
    output_len_max: int = 2048
    """Output lengths are clipped to ``[1, output_len_max]``."""
    num_requests: int | None = 2000
    arrival: Arrival = Poisson(8.0)

    def __post_init__(self) -> None:
        if self.header_len < 0 or self.prompt_len_max < 4 or self.output_len_max < 1:
            raise ValueError("header_len >= 0, prompt_len_max >= 4 and output_len_max >= 1 required")
        if min(self.prompt_len_median, self.output_len_median) <= 0:
            raise ValueError("medians must be > 0")
        if min(self.prompt_len_sigma, self.output_len_sigma) < 0:
            raise ValueError("sigmas must be >= 0")


def short_chat(name: str, params: ShortChatParams) -> Workload:
    """Build independent short chats."""
    times = schedule(params, params.num_requests or 0)
    rng = rng_for(params, "lengths")
    n = len(times)
    prompt = rng.lognormal(np.log(params.prompt_len_median), params.prompt_len_sigma, n)
    output = rng.lognormal(np.log(params.output_len_median), params.output_len_sigma, n)
    prompt_lens = np.clip(np.rint(prompt), 4, params.prompt_len_max).astype(int).tolist()
    output_lens = np.clip(np.rint(output), 1, params.output_len_max).astype(int).tolist()
    keys = Keys(params.seed, name)
    render = Renderer(params.form)
    header = keys.segment(params.header_len, "header")
    requests = []
    for i, (t, p_len, o_len) in enumerate(zip(times, prompt_lens, output_lens)):
        parts: list[tuple[Role, Segment]] = [("system", header), ("user", keys.segment(p_len, "user", i))]
        requests.append(
            Request(
                id=f"{name}-{i:06d}",
                arrival_s=t,
                max_output_tokens=o_len,
                **render.fields(parts),
            )
        )
    return assemble(name, params, requests)
