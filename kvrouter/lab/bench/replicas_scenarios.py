"""The scenarios of ``kvrouter bench replicas``: a fleet and how clients load it, each run as ``interleaved``
(the groups' prompts shuffled) and as ``bursts`` (each group's prompts one after another).

paced    the bench's own: a slow fleet (a quarter of its profile's speed, 400 blocks per instance), one
         client at Poisson 3 req/s (interleaved, 10 prompts per group) or bursts of 8 of one new prompt
         every 0.5 s, 1,400-token prompts, 40-token questions, 24 output tokens
clients  issue 29's: a fast fleet (the ``test`` profile at 20x, 420 blocks: not every prompt fits),
         8 concurrent clients (closed loop: each sends its next request when the last one is answered),
         10 chats of a short question per prompt, 4 output tokens; prompts of 1,800 tokens (about 1,400
         English words)

The live requests go round-robin over the routers (request i to router i mod N), as from a load balancer.
"""

from __future__ import annotations

import msgspec

from kvrouter.lab.workloads import make_workload
from kvrouter.lab.workloads.arrivals import Bursts, Poisson
from kvrouter.lab.workloads.spec import Workload

WORKLOADS = ("interleaved", "bursts")


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    profile: str | None = None
    """The simulated fleet's timing profile (``kvrouter sim --profile``; None: the simulator's default)."""
    speed: float
    """The simulated fleet runs this many times faster than its profile (``kvrouter sim --speed``)."""
    capacity_blocks: int
    """KV blocks per instance (16 tokens each)."""
    system_words: int
    """Tokens of each group's system prompt (the synthetic words are one token each)."""
    question_words: int
    output_tokens: int
    per_group: int
    """Prompts per group, interleaved (and in bursts unless ``burst`` says otherwise)."""
    burst: int | None = None
    """Prompts per group in bursts (None: ``per_group``)."""
    clients: int | None = None
    """Concurrent clients in a closed loop; None: requests at their arrival times (one open-loop client)."""
    rate: float = 3.0
    """Open loop, interleaved: Poisson arrivals, requests per second."""
    burst_gap_s: float = 0.5
    """Open loop, bursts: seconds between groups (each group's prompts all at once)."""


SCENARIOS: dict[str, Scenario] = {
    "paced": Scenario(
        speed=0.25,
        capacity_blocks=400,
        system_words=1400,
        question_words=40,
        output_tokens=24,
        per_group=10,
        burst=8,
    ),
    "clients": Scenario(
        profile="test",
        speed=20.0,
        capacity_blocks=420,
        system_words=1800,
        question_words=16,
        output_tokens=4,
        per_group=10,
        clients=8,
    ),
}


def workload(sc: Scenario, which: str, *, groups: int, seed: int) -> Workload:
    """The scenario's ``interleaved`` or ``bursts`` workload: chat requests, ``groups`` system prompts."""
    if which not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {which!r}")
    grouped = which == "bursts"
    per_group = (sc.burst or sc.per_group) if grouped else sc.per_group
    arrival: Bursts | Poisson | None
    if sc.clients is not None:
        arrival = None  # the closed loop sends them (``loadgen.drive(concurrency=...)``)
    elif grouped:
        arrival = Bursts(per_group, sc.burst_gap_s)
    else:
        arrival = Poisson(sc.rate)
    return make_workload(
        "sglang-gsp",
        form="chat",
        seed=seed,
        num_groups=groups,
        system_len=sc.system_words,
        question_len=sc.question_words,
        output_len=sc.output_tokens,
        prompts_per_group=per_group,
        grouped=grouped,
        **({"arrival": arrival} if arrival is not None else {}),
    )
