"""What every policy shares: the candidates it ranks, the request view it reads, and the two declarations
a policy module makes (its ``Policy`` and its ``PolicyConfig``).

::

    PolicyConfig (a msgspec Struct: the fleet file's routing.<field>)
      name, reads_index        ClassVars: the policy's name, whether its ranking reads the index
      fields                   its settings, each documented
      validate()               its own checks (``PolicySettings.validate`` runs every one, once)
      build(context)  ───────▶ Policy
                                 name
                                 rank(view, candidates, dry_run) -> candidates, best first
                                 reason(chosen) -> why the first choice won (cache, load, affinity, ...)

A policy only writes ``Candidate.score``; limits (spill, caps) are the router's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import msgspec

from indexer.hashing import I64Array

from ...types import InstanceId, TargetKey

if TYPE_CHECKING:
    from .latency_model import LatencyBook
    from .registry import PolicySettings
    from .session import SessionTable

MIN_WEIGHT = 1e-6
"""A target's weight is at least this in every load ratio (a weight of 0 means nearly never, not a division
by zero)."""


class Candidate(msgspec.Struct):
    """One routing target (an instance's data-parallel rank) as a policy sees it."""

    instance: InstanceId
    dp_rank: int
    target: TargetKey
    """``instance`` or ``instance/rank``: the key of load accounting and of the hash ring."""
    trust: str = "none"
    """The index's trust in this target (exact, partial, degraded, cold), or "none" without events."""
    matched_blocks: int = 0
    gpu_blocks: int = 0
    offload_blocks: int = 0
    speculative_blocks: int = 0
    tiers: dict[str, int] = {}
    """Credited blocks by tier (GPU, speculative, CPU, STORAGE, a shared store's name; 0s left out)."""
    cached_tokens: int = 0
    """Prompt tokens the target is credited with: each cached block at its tier's worth (``tier_value``),
    0 when its index is not trusted.  What kv-aware subtracts from the prefill to compute."""
    hit_tokens: int = 0
    """Prompt tokens vLLM is predicted to report as cached there (every tier in full)."""
    in_flight: int = 0
    others_in_flight: int = 0
    """Of ``in_flight``, what is not this router's own: other router replicas' requests (shared state, a
    round trip old) and whatever more the engine reports running or waiting (its last scrape)."""
    pending_prefill_tokens: int = 0
    decoding: int = 0
    kv_usage: float = 0.0
    """vLLM's KV-cache usage there (0-1, its last scrape; 0 when not scraped)."""
    weight: float = 1.0
    footprint: int = 0
    """GPU blocks the index holds for this target plus its speculative entries (0 when unknown): how much
    of its cache the traffic sent there fills; the same for every router fed the same events."""
    placed_blocks: int = 0
    """Blocks of new prompts placed here lately, by this router or another replica
    (``routing.placed_blocks``): what the placement band balances first."""
    saturated: bool = False
    """At or over the concurrency threshold: chosen only if every target is."""
    score: float = 0.0
    """The policy's score (lower is better), for explain and logs."""
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    """The latency models' predictions for this request here (``latency_model``), when a policy or
    explain asked for them."""

    @property
    def load(self) -> float:
        """Requests in flight per unit of weight: what every load comparison between targets compares."""
        return self.in_flight / max(self.weight, MIN_WEIGHT)

    @property
    def own_load(self) -> float:
        """This router's own requests in flight per unit of weight (``load`` less ``others_in_flight``)."""
        return (self.in_flight - self.others_in_flight) / max(self.weight, MIN_WEIGHT)


def load_cap(cands: list[Candidate], bound: float, slack: float) -> float | None:
    """The most load (``Candidate.load``) a target may carry before it is over the bound: ``bound`` x the
    mean load + ``slack`` (consistent hashing's bounded load, with slack).  None when there is no bound
    (``bound`` 0, or a single candidate)."""
    if not bound or len(cands) < 2:
        return None
    mean = sum(c.load for c in cands) / len(cands)
    return bound * mean + slack


class RouteView(msgspec.Struct):
    """What a policy may read about the request."""

    num_tokens: int
    prefix_key: bytes
    session: str | None = None
    now: float | None = None
    """The caller's clock (the session policy's expiry); None when the caller has none."""
    chains: I64Array | None = None
    """The prompt's chain hashes (None without a tokenizer): block i's covers the whole prefix up to it."""


class Policy(Protocol):
    """A built policy: ranks the candidates of one request.  ``dry_run`` asks for the ranking without
    advancing any state of its own (round-robin's pointer, a random generator): shadow scoring and
    explain ask every policy what it would do, on the same request, for free."""

    @property
    def name(self) -> str: ...

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]: ...

    def reason(self, chosen: Candidate) -> str:
        """Why ``chosen``, ranked first and not saturated, won: a ``Decision.reason`` (cache, load,
        affinity, session, ...).  The router itself says spill when the first choice was passed over."""
        ...


@dataclass(frozen=True)
class PolicyContext:
    """What building a policy may read besides its own settings."""

    settings: PolicySettings
    """Every policy's settings (a policy built on another one reads that one's here) and the seed."""
    sessions: SessionTable
    """The router's session table, filled on every dispatch whatever the policy."""
    latency: LatencyBook | None = None
    """The router's latency models, trained on every observed request whatever the policy (None: a
    policy that reads them makes its own)."""


class PolicyConfig(msgspec.Struct, frozen=True):
    """A policy's declaration and settings.  A subclass sets ``name`` and ``reads_index``, documents its
    fields and defines ``build``; a field of its type in ``PolicySettings`` registers it."""

    name: ClassVar[str]
    """The policy's name, as the fleet file, the command line and the metrics spell it."""
    reads_index: ClassVar[bool] = False
    """Whether the ranking reads cached tokens (the index).  A policy that does not ranks by load, turn
    or hash alone, so a simulation may leave the index out of its runs and get the same decisions."""

    def validate(self) -> None:
        """``ValueError`` naming the field when a setting is out of range (none by default)."""

    def build(self, context: PolicyContext) -> Policy:
        raise NotImplementedError
