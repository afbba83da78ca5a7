"""Which flow a request belongs to: its tenant (from its API key, else a configured header) and its
priority (the tenant's, or what the request asks for where the tenant may ask).  Pure: headers in, a flow
and the reasons of any header that was ignored out (the shell counts them).

Rules: a key's tenant always wins over the header; a header naming a tenant that has an API key is
ignored (a client without the key never borrows that tenant's priority or share); a named
``InferenceObjective`` gives the priority of tenants whose own is not configured, and may only lower a
configured one (raise it only where allowed); a priority header that is not an integer is ignored; a
priority above the tenant's is honoured only with ``allow_priority_header`` (and capped at
``max_priority``), a lower one always; a priority asked for that is not one of the configured levels
(``FlowsConfig.levels``) is taken as the highest level below it, or the lowest (counted: a client's
integers never make new priorities, accounts or metric series).  Header names are looked up in lower
case (the picker's map is lower-cased; the others ignore case).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Mapping, Sequence

from .config import FlowsConfig
from .scheduler import Flow


def identify(
    cfg: FlowsConfig,
    key_tenant: str | None,
    headers: Mapping[str, str],
    keyed: Collection[str],
    levels: Sequence[int] | None = None,
) -> tuple[Flow, list[str]]:
    """``key_tenant``: the tenant of the request's API key (None: no known key); ``keyed``: every tenant
    that has an API key; ``levels``: ``cfg.levels()``, computed once by the caller (None: here).  Returns
    the flow and the reasons headers were ignored or changed (``header:reason``)."""
    warnings: list[str] = []
    tenant = key_tenant
    if tenant is None and cfg.tenant_header:
        named = headers.get(cfg.tenant_header.lower())
        if named is not None:
            named = named.strip()
            if not named or len(named) > cfg.max_tenant_name or not named.isprintable():
                warnings.append("tenant:malformed")
            elif named in keyed:
                warnings.append("tenant:needs_key")
            else:
                tenant = named
    if tenant is None:
        tenant = cfg.default_tenant
    t = cfg.tenant(tenant)
    priority = t.priority
    objective = headers.get(cfg.objective_header.lower()) if cfg.objective_header else None
    if objective is not None:
        wanted = cfg.objectives.get(objective.strip())
        if wanted is None:
            warnings.append("objective:unknown")
        elif tenant not in cfg.tenants or wanted <= priority:
            priority = wanted
        elif not t.allow_priority_header:
            warnings.append("objective:not_allowed")
        else:
            priority = wanted if t.max_priority is None else min(wanted, t.max_priority)
    asked = headers.get(cfg.priority_header.lower()) if cfg.priority_header else None
    if asked is not None:
        try:
            want = int(asked.strip())
        except ValueError:
            warnings.append("priority:malformed")
        else:
            if want <= priority:
                priority = want
            elif not t.allow_priority_header:
                warnings.append("priority:not_allowed")
            else:
                priority = want if t.max_priority is None else min(want, t.max_priority)
            levels = cfg.levels() if levels is None else levels
            if priority not in levels:
                priority = levels[max(0, bisect_right(levels, priority) - 1)]
                warnings.append("priority:snapped")
    return Flow(tenant, priority), warnings
