"""The router's fleet file: the indexer's ``FleetConfig`` plus routing, limits, tenants and gateway.

Every key with its type, default and meaning is in docs/configuration.md (generated from these structs'
field docstrings); a fleet file in brief::

    block_size: 16
    tokenizer: /models/llama            # fleet-wide tokenizer (a local dir or an HF id in the local cache)
    models: {llama: {tokenizer: /models/llama, policy: kv-aware}}
    instances: [...]                    # see indexer.config
    routing: {policy: kv-aware, kv_aware: {compute_weight: 8.0, load_weight: 32}}
    limits: {queue_size: 256, queue_timeout_s: 30, saturation: {max_prefill_tokens: 2048, reserve: 0.5}}
    flows: {fairness: work, tenants: {team-a: {priority: 1}}}   # see kvrouter.flows.config

The whole file is validated once, when read (``RouterConfig``); a misspelt key is refused with its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from indexer.config import FleetConfig, load_yaml, parse_fleet
from indexer.errors import ConfigError

from .flows.config import FlowsConfig
from .membership.config import DiscoveryConfig, MembershipConfig
from .replicas.config import SharedStateConfig, SnapshotConfig
from .routing import KV_AWARE, DisaggSettings, PolicySettings
from .routing.isolation import Isolation
from .routing.router import RouterConfig
from .routing.saturation import Saturation
from .routing.tier_value import tier_values
from .telemetry.config import AccessLogConfig, TracingConfig


class ModelConfig(msgspec.Struct, frozen=True):
    tokenizer: str | None = None
    """This model's tokenizer (overrides the fleet's)."""
    chat_template: str | None = None
    """A chat template file or string, when the tokenizer has none (vLLM's --chat-template)."""
    policy: str | None = None
    """Routing policy for this model (overrides routing.policy)."""
    model_id: str | None = None
    """A multimodal model's ``--model`` as its vLLM instances were started with (a hub name or a path):
    vLLM hashes every image's bytes together with it, so the router needs the same string to name images
    as vLLM does (docs/multimodal.md).  Default: the model's tokenizer."""


class RoutingConfig(PolicySettings, frozen=True):
    """The fleet file's ``routing:`` section: every policy's settings (``PolicySettings``, whose fields
    register the policies) and the router's own choices."""

    policy: str = KV_AWARE
    """The default policy (``models.<name>.policy`` overrides it per model)."""
    speculative: bool = True
    """Speculative index entries for requests just sent (a burst of a new prefix stays together)."""
    shadow: bool = True
    """Shadow scoring: what every other policy would have chosen, as metrics."""
    shadow_every: int = 16
    """Shadow-score one decision in this many (1: every one).  Asking five other policies costs about
    as much CPU as the decision itself; a sample tells the same shares (``kvrouter_shadow_scored_total``
    counts the decisions scored)."""
    disaggregation: DisaggSettings = DisaggSettings()
    """How models whose instances have prefill/decode roles are split (``routing.disagg``)."""

    def validate(self) -> None:
        """``ValueError`` for a setting out of range or a default policy that no policy has."""
        super().validate()
        self.config(self.policy)
        self.disaggregation.validate(self.names())


class LimitsConfig(msgspec.Struct, frozen=True):
    concurrency_threshold: int = 0
    """Per-instance requests in flight at which new requests spill to the next-best instance (0: off)."""
    max_in_flight: int = 0
    """Per-instance hard cap; when all instances are at it, requests wait in the queue (0: no cap)."""
    saturation: Saturation = Saturation()
    """When an instance is full by the fleet's own signals (prompt tokens still to prefill there, vLLM's
    KV-cache usage), and the share of every limit kept for high priority (``routing.saturation``)."""
    isolation: Isolation = Isolation()
    """Quiet targets: a share of each model's instances that heavy flows (over their share of the work,
    or below ``quiet_priority``) never use (``routing.isolation``; off by default)."""
    queue_size: int = 256
    """Requests allowed to wait for capacity; beyond it the gateway answers 429 with Retry-After."""
    queue_timeout_s: float = 30.0
    """How long a request waits for capacity before a 429."""
    early_refusal: bool = True
    """Refuse at once (429, reason ``expected_timeout``) a request the queue would keep past
    ``queue_timeout_s``, judged from the waits seen so far (places ahead of it x seconds per place),
    instead of answering the same 429 one timeout later."""
    retry_after_s: int = 1
    max_requests: int = 4096
    """OpenAI requests the gateway holds at once, streams included; beyond it the next gets 429 with
    Retry-After before its body is read (0: no limit).  A bound on the gateway's memory and backlog,
    which no per-instance cap sees."""
    max_loop_lag_s: float = 0.0
    """Past this standing delay of a worker's event loop (behind on every turn for 0.1 s: its CPU is the
    bottleneck), the worker refuses new requests with 429 and Retry-After before reading their body: a
    share of them rising from 0 at this delay to all at twice it (``pipeline.admission``).  One long stall
    refuses nothing.  0 (the default): off, admission by ``max_requests`` alone.  Opt in (e.g. 0.025) on
    a host whose CPUs the gateway does not share: beside busy engines on the same cores, a loop kept
    waiting for a CPU reads as behind and sequential requests were refused."""
    max_body_bytes: int = 32 << 20
    """Largest request body accepted (413 beyond)."""


class Tenant(msgspec.Struct, frozen=True):
    name: str
    salt: str | None = None
    """Injected as cache_salt into this tenant's requests, so its cache is its own."""


class TenantsConfig(msgspec.Struct, frozen=True):
    require_api_key: bool = False
    """Reject OpenAI requests whose bearer key is not listed (401)."""
    api_keys: dict[str, Tenant] = {}


class GatewayConfig(msgspec.Struct, frozen=True):
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 120.0
    """An upstream that sends no response headers in this time is taken as hung (failure, retried)."""
    chunk_timeout_s: float = 120.0
    """A stream silent this long is ended with an error event."""
    request_timeout_s: float = 3600.0
    max_retries: int = 2
    """Retries on the next-best instance for connection errors and 5xx before the first byte."""
    health_interval_s: float = 1.0
    health_timeouts: int = 2
    """/health checks in a row that get no answer within twice ``health_interval_s`` (0.5 s at least)
    before an instance leaves rotation.  One slow answer from a busy API server is not a verdict; an
    instance that refuses the connection or answers non-200 (down, or saying so) leaves at once."""
    metrics_interval_s: float = 1.0
    failure_threshold: int = 3
    """Failed requests in a row (no success between them, no failing health check) that take an instance
    out of rotation: for ``ejection_s`` at least if its /health keeps passing."""
    ejection_s: float = 10.0
    """After ``failure_threshold`` failed requests (5xx, or no first byte in time: not connection errors)
    the instance stays out at least this long even if its /health passes (a hung engine behind a live HTTP
    server), twice as long after each further ejection within ``ejection_max_s``.  0: no ejection."""
    ejection_max_s: float = 300.0
    admin_token: str | None = None
    """If set, every admin path (``kvrouter.api.routes.ADMIN_PATHS``: the router's explain, lookup and fleet
    routes and vLLM's operator routes, such as /sleep or /v1/load_lora_adapter) requires
    `Authorization: Bearer <token>`, through the gateway and the endpoint picker alike."""
    upstream_api_key: str | None = None
    """If set, sent upstream as the bearer key instead of the client's."""
    indexer_url: str | None = None
    """Use a remote `kvrouter indexer` instead of the embedded one."""
    lean_client: bool = True
    """Send routed requests to http:// upstreams through the gateway's own HTTP/1.1 client
    (``gateway/upstream_http.py``), which costs less CPU per request than aiohttp's; false: aiohttp's."""
    front: Literal["aiohttp", "lean"] = "lean"
    """The server in front: ``lean`` serves the routed routes (completions, chat, responses, messages,
    invocations, pooling: POST) with its own HTTP/1.1 core (``gateway/lean``) and hands every other
    request's connection to aiohttp on the same port; ``aiohttp``: aiohttp serves every route."""


class ParityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = True
    """Check token parity against the fleet's own ``/tokenize``."""
    sample_rate: float = 0.01
    """Fraction of live requests whose token ids are checked (after they were routed, off their path)."""
    startup: bool = True
    """Check each model's probe set at start-up (and whenever it fails, until it passes)."""
    recheck_interval_s: float = 10.0
    """While a model's parity fails, its probe set is checked again this often."""
    shortfall_blocks: int = 1
    """Check a request when vLLM reports at least this many blocks fewer cached tokens than predicted."""
    timeout_s: float = 2.0
    """One /tokenize call."""
    queue: int = 64
    """Checks waiting at most; more are dropped (counted), never queued without bound."""

    def validate(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ConfigError("parity.sample_rate must be in [0, 1]")
        if self.recheck_interval_s <= 0 or self.timeout_s <= 0 or self.queue < 1 or self.shortfall_blocks < 1:
            raise ConfigError(
                "parity: recheck_interval_s and timeout_s must be > 0, queue and shortfall_blocks >= 1"
            )


class ResponsesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where stored Responses API answers are: vLLM keeps them in one instance's memory."""

    affinity_ttl_s: float = 86_400.0
    """How long the instance that produced a response id is remembered (vLLM keeps it until it restarts)."""
    max_entries: int = 500_000
    """Response ids remembered at most (the first to expire are forgotten first; about 100 B each)."""
    probe: bool = True
    """An id not remembered (made before this router started, or by a replica whose news did not arrive) is
    looked for on every healthy instance (``GET /v1/responses/{id}``) before answering 404."""
    probe_timeout_s: float = 2.0
    history_entries: int = 10_000
    """Stored responses whose conversation (the messages vLLM rendered and the output it answered) each
    router process keeps, so that a continuation (``previous_response_id``) is tokenized as vLLM renders it
    and routed on its cached blocks like any request (0: none kept; continuations go to their instance
    without tokens)."""
    history_bytes: int = 64 << 20
    """The most those conversations hold in all, as JSON bytes (the least recently used go first)."""

    def validate(self) -> None:
        if self.affinity_ttl_s <= 0 or self.max_entries < 1 or self.probe_timeout_s <= 0:
            raise ConfigError("responses: affinity_ttl_s and probe_timeout_s must be > 0, max_entries >= 1")
        if self.history_entries < 0 or self.history_bytes < 0:
            raise ConfigError("responses: history_entries and history_bytes must be >= 0")


class AdapterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    """What ``/v1/load_lora_adapter`` is given as ``lora_path``."""
    base: str | None = None
    """The model it adapts (default: the fleet's first model)."""


class LoraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """LoRA adapters.  Where each is loaded is learned from every instance's ``/v1/models`` (and from the
    load and unload requests the gateway passes on); these are the ones the gateway may load itself."""

    adapters: dict[str, AdapterConfig] = {}
    load_on_demand: bool = False
    """A request naming one of ``adapters`` that no healthy instance has loaded: load it onto the instance
    the router picks for the request (vLLM needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), then route there."""
    load_timeout_s: float = 60.0


class RouterFleetConfig(FleetConfig, frozen=True, forbid_unknown_fields=True):
    chat_template: str | None = None
    """The fleet's chat template (a file or a Jinja string), when its tokenizer has none."""
    models: dict[str, ModelConfig] = {}
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    tenants: TenantsConfig = TenantsConfig()
    gateway: GatewayConfig = GatewayConfig()
    flows: FlowsConfig = FlowsConfig()
    """Tenants' priorities, fair shares and rate limits, for requests that wait for capacity."""
    replicas: SharedStateConfig = SharedStateConfig()
    """Replicas sharing in-flight load and speculative entries through Redis (``KVROUTER_REDIS_URL``)."""
    snapshot: SnapshotConfig = SnapshotConfig()
    """Periodic index snapshots (a file or a Redis key) for warm restarts."""
    membership: MembershipConfig = MembershipConfig()
    """Fleet-file reload and draining of leaving instances."""
    discovery: DiscoveryConfig | None = None
    """Kubernetes discovery: instances from the EndpointSlices of a vLLM Service."""
    parity: ParityConfig = ParityConfig()
    """Token parity with the fleet: checked at start-up, on sampled requests and on cache shortfalls."""
    responses: ResponsesConfig = ResponsesConfig()
    """Stored Responses API answers: which instance holds each id."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters the gateway may load on demand."""
    tracing: TracingConfig = TracingConfig()
    """OpenTelemetry traces of sampled requests, exported over OTLP (the ``OTEL_*`` variables apply)."""
    access_log: AccessLogConfig = AccessLogConfig()
    """One structured line per request (or per sampled request) on the ``kvrouter.access`` logger."""

    def served_models(self) -> list[str | None]:
        """Every model name the fleet serves, after None (the fleet's default tokenizer): what a gateway
        or indexer loads tokenizers for at start-up."""
        models: list[str | None] = [None, *self.models]
        for inst in self.instances:
            models.extend(m for m in inst.models if m not in models)
        return models

    def validate(self) -> None:
        super().validate()
        g = self.gateway
        if g.ejection_s < 0 or g.ejection_max_s < g.ejection_s:
            raise ConfigError("gateway.ejection_s must be >= 0 and <= gateway.ejection_max_s")
        self.replicas.validate()
        self.flows.validate()
        self.snapshot.validate()
        self.membership.validate()
        self.parity.validate()
        self.responses.validate()
        self.tracing.validate()
        self.access_log.validate()
        if self.discovery is not None:
            self.discovery.validate()
        try:
            self.routing.validate()
            for m in self.models.values():
                if m.policy:
                    self.routing.config(m.policy)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.limits.queue_size < 0 or self.limits.queue_timeout_s <= 0:
            raise ConfigError("limits: queue_size must be >= 0 and queue_timeout_s > 0")
        self.limits.saturation.validate()
        self.limits.isolation.validate()
        if self.limits.max_requests < 0 or self.limits.max_loop_lag_s < 0:
            raise ConfigError("limits: max_requests and max_loop_lag_s must be >= 0")
        if self.routing.shadow_every < 1:
            raise ConfigError("routing.shadow_every must be at least 1")

    def router_config(self, policy: str | None = None) -> RouterConfig:
        r = self.routing
        return RouterConfig(
            policy=policy or r.policy,
            model_policies={k: m.policy for k, m in self.models.items() if m.policy},
            concurrency_threshold=self.limits.concurrency_threshold,
            max_in_flight=self.limits.max_in_flight,
            saturation=self.limits.saturation,
            isolation=self.limits.isolation,
            speculative=r.speculative,
            shadow=r.shadow,
            settings=r,
            tiers=tier_values(self.tiers),
        )

    def tokenizer_for(self, model: str | None) -> str | None:
        m = self.models.get(model or "")
        return (m.tokenizer if m and m.tokenizer else None) or self.tokenizer


def load_router_fleet(path: str | Path) -> RouterFleetConfig:
    cfg = parse_fleet(load_yaml(path), RouterFleetConfig)
    try:
        tracing = cfg.tracing.with_env()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return msgspec.structs.replace(cfg, replicas=cfg.replicas.with_env(), tracing=tracing)
