"""The registry of policies: ``PolicySettings``, one field per policy holding that policy's settings.

Adding a policy is one module (its ``PolicyConfig`` and its ``Policy``) and one field here; the field's
name is the policy's key in the fleet file's ``routing:`` section (``routing.kv_aware.load_weight``), and
the order of the fields is the order policies are listed in (evaluations, shadow scoring).  A struct
deriving from ``PolicySettings`` with fields of its own registers more policies for the routers given it,
without touching this module.
"""

from __future__ import annotations

import msgspec

from .base import Policy, PolicyConfig, PolicyContext
from .kv_aware import KvAwareSettings
from .latency_model import LatencyBook
from .least_loaded import LeastLoadedSettings
from .predicted_latency import PredictedLatencySettings
from .prefix_hash import PrefixHashSettings
from .random_order import RandomSettings
from .round_robin import RoundRobinSettings
from .session import SessionSettings, SessionTable


class PolicySettings(msgspec.Struct, frozen=True):
    """Every policy's settings (the fleet file's ``routing:`` section, with the router's own fields:
    ``kvrouter.config.RoutingConfig``)."""

    kv_aware: KvAwareSettings = KvAwareSettings()
    prefix_hash: PrefixHashSettings = PrefixHashSettings()
    least_loaded: LeastLoadedSettings = LeastLoadedSettings()
    round_robin: RoundRobinSettings = RoundRobinSettings()
    random: RandomSettings = RandomSettings()
    session: SessionSettings = SessionSettings()
    """The session policy: the header naming a session, how long one is remembered, how many."""
    predicted_latency: PredictedLatencySettings = PredictedLatencySettings()
    """Lowest predicted TTFT from latency models learned online; its ``model`` is every router's."""
    seed: int = 0
    """The seed of every policy that draws random numbers (least-loaded's ties, random)."""

    def configs(self) -> dict[str, PolicyConfig]:
        """Every registered policy's settings by the policy's name, in field order."""
        out: dict[str, PolicyConfig] = {}
        for f in msgspec.structs.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, PolicyConfig):
                out[v.name] = v
        return out

    def names(self) -> tuple[str, ...]:
        return tuple(self.configs())

    def config(self, name: str) -> PolicyConfig:
        """The settings of the policy called ``name``; ``ValueError`` naming the valid ones if none is."""
        configs = self.configs()
        c = configs.get(name)
        if c is None:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(configs)}")
        return c

    def build(
        self, name: str, sessions: SessionTable | None = None, latency: LatencyBook | None = None
    ) -> Policy:
        """The policy called ``name``.  ``sessions``: the table the session policy reads (the router's,
        filled on every dispatch); a new one when None.  ``latency``: the router's latency models."""
        ctx = PolicyContext(self, sessions or SessionTable(self.session), latency)
        return self.config(name).build(ctx)

    def validate(self) -> None:
        """Every policy's own checks; ``ValueError`` naming the setting (``routing.<field>.<setting>``)."""
        for f in msgspec.structs.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, PolicyConfig):
                try:
                    v.validate()
                except ValueError as e:
                    raise ValueError(f"routing.{f.encode_name}.{e}") from None


BUILT_IN = PolicySettings()

ALL_POLICIES: tuple[str, ...] = BUILT_IN.names()
"""The built-in policies' names, in registry order."""

READS_INDEX = frozenset(n for n, c in BUILT_IN.configs().items() if c.reads_index)
"""The built-in policies whose ranking reads cached tokens (``PolicyConfig.reads_index``)."""


def policy_name(name: str) -> str:
    """``name`` if a built-in policy has it; ``ValueError`` naming the valid ones otherwise."""
    BUILT_IN.config(name)
    return name


def make_policy(
    name: str, settings: PolicySettings | None = None, sessions: SessionTable | None = None
) -> Policy:
    """The policy called ``name``, built from ``settings`` (default: every default)."""
    return (settings or BUILT_IN).build(name, sessions)
