"""The fleet file's ``flows:`` section: who a request is for (its tenant), how much it matters (its
priority) and how the queue is shared when every instance is at its cap.

::

    flows:
      fairness: work                 # fifo | requests | vtc | work
      tenant_header: x-tenant-id     # tenants without an API key name themselves here (null: off)
      priority_header: x-priority    # an integer; honoured only for tenants allowed to set it
      objectives: {premium: 2, batch: -1}   # InferenceObjective name -> its spec.priority
      default_priority: 0
      expected_output_tokens: 256    # the decode charged before vLLM says (capped by max_tokens)
      tenants:
        team-a: {priority: 1, weight: 1.0, requests_per_minute: 600, tokens_per_minute: 200000}
        batch:  {priority: -1}       # below 0: sheddable, never queued while the fleet is saturated
"""

from __future__ import annotations

from typing import Literal

import msgspec

from indexer.errors import ConfigError

from .slo import SloConfig

DEFAULT_MAX_FLOWS = 100_000
SHEDDABLE = -1
"""The priority a request may always lower itself to, configured or not: below 0, refused at once while
the fleet is saturated."""

Fairness = Literal["fifo", "requests", "vtc", "work"]
FAIRNESS: tuple[Fairness, ...] = ("fifo", "requests", "vtc", "work")
"""``fifo``: one queue in arrival order, priorities ignored (the router before flows).  The others serve
the highest priority first and, within a priority, the flow with the least service so far, counted in:
``requests`` (one per request: round robin between flows, as the inference extension's flow control);
``vtc`` (prompt tokens plus generated tokens: the virtual token counter); ``work`` (the tokens the fleet
computes: prompt tokens the index says are not cached where the request goes, plus its decode)."""


class TenantFlow(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    priority: int = 0
    """Higher is served first and shed last; below 0 is sheddable (refused at once when saturated)."""
    weight: float = 1.0
    """This tenant's share against others of its priority (2.0: twice the work of a 1.0 tenant)."""
    allow_priority_header: bool = False
    """Whether requests may set their own priority (``priority_header``) above the tenant's; any tenant may
    lower its own."""
    max_priority: int | None = None
    """With ``allow_priority_header``: the highest priority its requests may ask for (None: any)."""
    requests_per_minute: float = 0.0
    """Sustained requests per minute (0: no limit), with a burst of as many as a minute allows."""
    tokens_per_minute: float = 0.0
    """Sustained prompt plus expected output tokens per minute (0: no limit)."""


class FlowsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fairness: Fairness = "work"
    tenant_header: str | None = None
    """A header naming the tenant of requests whose API key names none (a key's tenant always wins, and a
    tenant that has a key is never taken from the header)."""
    priority_header: str | None = "x-priority"
    objective_header: str | None = "x-gateway-inference-objective"
    """The header naming the request's ``InferenceObjective`` (the Gateway API Inference Extension's)."""
    objectives: dict[str, int] = {}
    """Each ``InferenceObjective``'s priority, by name.  A named objective sets the priority of requests
    from tenants whose priority is not configured here (``tenants``); for those that are, it may lower it,
    and raise it only with ``allow_priority_header``.  An unknown name is ignored (counted)."""
    default_priority: int = 0
    """The priority of requests from tenants not configured here."""
    default_tenant: str = "default"
    """The flow of requests that name no tenant."""
    expected_output_tokens: int = 256
    """Decode tokens a request is charged at admission, at most its ``max_tokens`` (corrected when vLLM
    reports what it generated)."""
    tenants: dict[str, TenantFlow] = {}
    max_tenant_name: int = 64
    """Longer header tenant names are refused (counted) and the request is the default tenant's."""
    max_flows: int = DEFAULT_MAX_FLOWS
    """Flows (tenant, priority) whose service each router process keeps count of.  Beyond it the least
    recently charged flow without waiters is forgotten, and comes back as a new flow: the memory stays
    bounded when a header names millions of users (``flows.LocalAccounts``)."""
    slo: SloConfig = SloConfig()
    """SLO-aware admission: TTFT/TPOT objectives stated in headers, predicted before waiting
    (``flows.slo``)."""

    def levels(self) -> tuple[int, ...]:
        """The priorities a request can have, ascending: the ones this section names (``default_priority``,
        each tenant's ``priority`` and ``max_priority``, each objective's, ``slo.demote_priority``) and
        ``SHEDDABLE``.  A priority asked for by header that is not one of them is taken as the highest below
        it (``identify``): the priorities, and every per-priority account and metric label, stay as few as
        the configuration makes them, whatever integers clients send."""
        out = {self.default_priority, SHEDDABLE, self.slo.demote_priority, *self.objectives.values()}
        for t in self.tenants.values():
            out.add(t.priority)
            if t.max_priority is not None:
                out.add(t.max_priority)
        return tuple(sorted(out))

    def tenant(self, name: str) -> TenantFlow:
        t = self.tenants.get(name)
        return t if t is not None else TenantFlow(priority=self.default_priority)

    def validate(self) -> None:
        if self.fairness not in FAIRNESS:
            raise ConfigError(f"flows.fairness must be one of {', '.join(FAIRNESS)}")
        self.slo.validate()
        if self.expected_output_tokens < 0 or self.max_tenant_name < 1 or self.max_flows < 1:
            raise ConfigError(
                "flows: expected_output_tokens must be >= 0, max_tenant_name and max_flows >= 1"
            )
        for name, t in self.tenants.items():
            if t.weight <= 0 or t.requests_per_minute < 0 or t.tokens_per_minute < 0:
                raise ConfigError(
                    f"flows.tenants.{name}: weight must be > 0, requests/tokens_per_minute >= 0"
                )
