"""Tenants with ``cache_salt``: the same prompts sent by several tenants, each under its own salt.

::

    tenant 0 (salt s0):  [system g][question g,p]     \\
    tenant 1 (salt s1):  [system g][question g,p]      > token-identical prompts, disjoint cache keys
    tenant 2 (salt s2):  [system g][question g,p]     /

vLLM keys a salted request's first block on the salt (and so every block after it), so tenants never hit
each other's blocks: a router that ignores the salt predicts cross-tenant hits that the engine never
delivers.  ``salted=False`` sends the same workload without salts, the comparison that shows the leak.
Per-tenant figures come from ``Request.tenant`` (e.g. ``reuse_ceiling_by(w, lambda r: r.tenant)``).
"""

from __future__ import annotations

from kvrouter.lab.workloads.arrivals import Arrival, Poisson
from kvrouter.lab.workloads.build import GeneratorParams, Keys, Renderer, assemble, rng_for, schedule
from kvrouter.lab.workloads.shared_prefix import SharedPrefixParams
from kvrouter.lab.workloads.spec import Request, Role, Segment, Workload


class TenantsParams(GeneratorParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tenants sending one shared-prefix prompt set, each under its own ``cache_salt``."""

    num_tenants: int = 4
    """Tenants; each sends every prompt of the set once (in its own shuffled order) by default."""
    salted: bool = True
    """Give each tenant its own ``cache_salt``; False: no salts (cross-tenant sharing)."""
    num_groups: int = 16
    """Distinct system prompts of the prompt set."""
    prompts_per_group: int = 8
    """Questions per system prompt."""
    system_len: int = 2048
    """Tokens of each system prompt."""
    question_len: int = 128
    """Tokens of each question."""
    output_len: int = 128
    """Tokens generated per request."""
    arrival: Arrival = Poisson(8.0)

    def __post_init__(self) -> None:
        if self.num_tenants < 1:
            raise ValueError("num_tenants must be >= 1")
        # Reuse the shared-prefix checks on the prompt-set fields.
        SharedPrefixParams(
            num_groups=self.num_groups,
            prompts_per_group=self.prompts_per_group,
            system_len=self.system_len,
            question_len=self.question_len,
            output_len=self.output_len,
        )


def tenant_salt(seed: int, tenant: int) -> str:
    """A tenant's salt: unguessable-looking, deterministic per seed (real salts are secrets)."""
    return f"salt-{Keys(seed, 'tenants')('salt', tenant):016x}"


def tenants(name: str, params: TenantsParams) -> Workload:
    """Build the tenants' interleaved requests."""
    size = params.num_groups * params.prompts_per_group
    times = schedule(params, size * params.num_tenants)
    rng = rng_for(params, "tenants")
    # Request i goes to tenant who[i]; each tenant walks its own shuffle of the prompt set, cyclically.
    who = rng.permutation(len(times)) % params.num_tenants
    orders = [rng.permutation(size).tolist() for _ in range(params.num_tenants)]
    sent = [0] * params.num_tenants
    keys = Keys(params.seed, name)  # prompt content does not depend on the tenant
    render = Renderer(params.form)
    requests = []
    for i, (t, tenant) in enumerate(zip(times, who.tolist())):
        prompt = orders[tenant][sent[tenant] % size]
        sent[tenant] += 1
        g, q = divmod(prompt, params.prompts_per_group)
        parts: list[tuple[Role, Segment]] = [
            ("system", keys.segment(params.system_len, "system", g)),
            ("user", keys.segment(params.question_len, "question", g, q)),
        ]
        label = f"tenant-{tenant}"
        requests.append(
            Request(
                id=f"{name}-{i:06d}",
                arrival_s=t,
                max_output_tokens=params.output_len,
                cache_salt=tenant_salt(params.seed, tenant) if params.salted else None,
                tenant=label,
                affinity_id=label,
                group=f"{label}/g{g:03d}",
                **render.fields(parts),
            )
        )
    return assemble(name, params, requests)
