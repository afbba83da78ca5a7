"""The fleet as the gateway sees it: which instances are in rotation, what they serve, how loaded.

Active checks: ``GET /health`` every ``health_interval_s`` (refused or non-200: out at once; no answer:
out after ``health_timeouts`` in a row), reading ``/v1/models`` with each passing one.  Passive checks: a
connection error takes an instance out until /health passes; ``failure_threshold`` failures (5xx, no
first byte in time) eject it for ``ejection_s`` at least, doubling with each ejection within
``ejection_max_s`` of the last.  Engine load: ``GET /metrics`` every ``metrics_interval_s``.

Invariant: a request never waits on an instance known to be dead (it is not a candidate).  Ejection is
for an instance whose HTTP server answers /health while its engine fails every request (as Envoy's
outlier detection).  With ``serve --workers N``, ``board`` holds the host's one view of health and
ejections: any worker's failure counts toward the same threshold, every worker runs health checks, and
only the leader (worker 0) scrapes engine load.  Membership changes the pool at run time: ``add``
(health-checked before traffic), ``drain`` (no new requests; ``in_flight`` tells when done), ``remove``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from types import MappingProxyType

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from indexer.config import InstanceConfig

from ..host import HealthBoard
from ..loop_lag import LoopLag
from ..routing import LoadTracker
from ..routing.router import Target
from ..types import InstanceId

log = logging.getLogger("kvrouter.gateway.upstream")

_NO_ADAPTERS: Mapping[str, str] = MappingProxyType({})


class Upstream(msgspec.Struct):
    cfg: InstanceConfig
    healthy: bool = True
    """Optimistic at start: the first failed check or connection error takes it out."""
    failures: int = 0
    ejections: int = 0
    """Ejections in the current run (each one within ``ejection_max_s`` of the previous)."""
    ejected_until: float = 0.0
    """Monotonic time before which a passing health check does not put the instance back."""
    last_ejection: float = float("-inf")
    served_models: list[str] = []
    """Every model id the instance's /v1/models lists (base models and loaded adapters)."""
    adapters: dict[str, str] = {}
    """Loaded LoRA adapters: name -> the model it adapts (cards with a ``parent``)."""
    last_check: float | None = None
    check_timeouts: int = 0
    """/health checks in a row that got no answer in time (this process's own checks)."""
    draining: bool = False
    """Leaving the fleet: no new requests (it is not a candidate); requests in flight run to the end."""

    @property
    def name(self) -> str:
        return self.cfg.name

    def targets(self, model: str | None = None) -> list[Target]:
        """Its ranks as routing targets for requests naming ``model`` (its role may depend on it)."""
        c = self.cfg
        role = c.role_for(model)
        return [
            Target(InstanceId(self.name), r, c.dp_size, c.events is not None, self.healthy, c.weight, role)
            for r in range(c.dp_size)
        ]

    def serves(self, model: str | None, adapters: Collection[str] = ()) -> bool:
        """Whether requests for ``model`` may come here.  ``adapters``: every adapter name known anywhere
        (one of them is served only where it is loaded)."""
        if model is None or model in self.adapters:
            return True
        if model in adapters:
            return False
        if self.cfg.models:
            return model in self.cfg.models
        return not self.served_models or model in self.served_models


class UpstreamPool:
    def __init__(
        self,
        instances: list[InstanceConfig],
        load: LoadTracker,
        *,
        health_interval_s: float = 1.0,
        metrics_interval_s: float = 1.0,
        failure_threshold: int = 3,
        health_timeouts: int = 2,
        ejection_s: float = 0.0,
        ejection_max_s: float = 300.0,
        on_change: Callable[[str, bool], None] | None = None,
        on_eject: Callable[[str, float], None] | None = None,
        board: HealthBoard | None = None,
        scrape_engines: bool = True,
        lag: LoopLag | None = None,
    ) -> None:
        self.lag = lag
        """This process's event-loop delay: a check that timed out while the loop stood still says
        nothing about the instance (None: every timeout counts)."""
        self.board = board
        """The host's shared health (several workers); None: this process's own view is the truth."""
        self.scrape_engines = scrape_engines
        """Scrape engine load (False: a worker that reads the leader's scrapes off the shared loads)."""
        self._board_seen = -1
        self.upstreams: dict[str, Upstream] = {i.name: Upstream(i) for i in instances if i.url}
        self.load = load
        self.health_interval_s = health_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.failure_threshold = failure_threshold
        self.health_timeouts = max(1, health_timeouts)
        self.ejection_s = ejection_s
        self.ejection_max_s = ejection_max_s
        self.on_change = on_change
        self.on_eject = on_eject
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self.configured_adapters: dict[str, str] = {}
        """Adapters the gateway may load itself (fleet file ``lora.adapters``): name -> base model."""

    # ------------------------------------------------------------------ the host's shared view
    def sync(self) -> None:
        """Take what other workers of the host wrote (a version compare when nothing changed)."""
        b = self.board
        if b is None or b.version() == self._board_seen:
            return
        self._board_seen = b.version()
        for u in list(self.upstreams.values()):
            if b.pull(u):
                self._changed(u)

    @contextlib.contextmanager
    def _edit(self, u: Upstream) -> Iterator[None]:
        """A read-modify-write of ``u``'s health: under the host's lock, from the host's current record."""
        b = self.board
        if b is None:
            yield
            return
        with b.lock:
            if b.pull(u):
                self._changed(u)
            yield
            b.push(u)

    # ------------------------------------------------------------------ queries
    def known_adapters(self) -> Mapping[str, str]:
        """Every adapter loaded anywhere or configured: name -> base model (read-only)."""
        ups = self.upstreams.values()
        if not self.configured_adapters and not any(u.adapters for u in ups):
            return _NO_ADAPTERS  # (the common case, asked several times a request: no dict built)
        out = dict(self.configured_adapters)
        for u in ups:
            out.update(u.adapters)
        return out

    def targets(self, model: str | None) -> list[Target]:
        self.sync()
        adapters = self.known_adapters()
        return [
            t
            for u in self.upstreams.values()
            if u.serves(model, adapters) and not u.draining
            for t in u.targets(adapters.get(model, model) if model is not None else None)
        ]

    def known_model(self, model: str | None) -> bool:
        adapters = self.known_adapters()
        return model in adapters or any(u.serves(model, adapters) for u in self.upstreams.values())

    def base_model(self, model: str | None) -> str | None:
        return None if model is None else self.known_adapters().get(model)

    def instance_targets(self, name: str) -> list[Target] | None:
        u = self.upstreams.get(name)
        return None if u is None else u.targets()

    def holders(self, adapter: str) -> list[str]:
        """Instances with ``adapter`` loaded."""
        return [u.name for u in self.upstreams.values() if adapter in u.adapters]

    def adapter_loaded(self, name: str, adapter: str, base: str) -> None:
        u = self.upstreams.get(name)
        if u is not None:
            u.adapters = {**u.adapters, adapter: base}
            if u.served_models and adapter not in u.served_models:
                u.served_models = [*u.served_models, adapter]

    def adapter_unloaded(self, name: str, adapter: str) -> None:
        u = self.upstreams.get(name)
        if u is not None and adapter in u.adapters:
            u.adapters = {k: v for k, v in u.adapters.items() if k != adapter}
            u.served_models = [m for m in u.served_models if m != adapter]

    def models(self) -> list[str]:
        names: dict[str, None] = {}
        for u in self.upstreams.values():
            for m in [*u.cfg.models, *u.served_models]:
                names[m] = None
        return list(names)

    def url(self, name: str) -> str:
        url = self.upstreams[name].cfg.url
        assert url is not None
        return url.rstrip("/")

    # ------------------------------------------------------------------ membership
    async def add(self, cfg: InstanceConfig) -> Upstream | None:
        """Add an instance (None if it has no url: nothing to proxy to).  A known name only takes the new
        config.  Once the pool runs, a new instance takes traffic only after its first health check passes."""
        if not cfg.url:
            return None
        u = self.upstreams.get(cfg.name)
        if u is not None:
            u.cfg = cfg
            return u
        u = self.upstreams[cfg.name] = Upstream(cfg, healthy=self._session is None)
        if self._session is not None:
            await self._check(u)
        return u

    def drain(self, name: str, draining: bool = True) -> None:
        """Stop (or, with ``draining=False``, resume) routing new requests to ``name``."""
        u = self.upstreams.get(name)
        if u is not None:
            u.draining = draining

    def in_flight(self, name: str) -> int:
        """Requests this router (every worker of the host) sent to ``name`` that have not finished (all its
        ranks)."""
        u = self.upstreams.get(name)
        if u is None:
            return 0
        self.load.refresh([t.key for t in u.targets()])
        loads = self.load.loads
        return sum(loads[k].in_flight for t in u.targets() if (k := t.key) in loads)

    def remove(self, name: str) -> Upstream | None:
        """Drop ``name`` and its load accounting (requests still in flight no longer count anywhere)."""
        u = self.upstreams.pop(name, None)
        if u is not None:
            for t in u.targets():
                self.load.forget(t.key)
        return u

    # ------------------------------------------------------------------ passive checks
    def _set(self, u: Upstream, healthy: bool) -> None:
        if u.healthy != healthy:
            u.healthy = healthy
            log.warning(
                "instance %s",
                "back in rotation" if healthy else "out of rotation",
                extra={"instance": u.name},
            )
            self._changed(u)

    def _changed(self, u: Upstream) -> None:
        # A check that was under way when its instance was removed reports to no one.
        if self.on_change and self.upstreams.get(u.name) is u:
            self.on_change(u.name, u.healthy)

    def record_failure(self, name: str, *, connection: bool) -> None:
        u = self.upstreams.get(name)
        if u is None:
            return
        with self._edit(u):
            u.failures += 1
            if not connection and u.failures < self.failure_threshold:
                return
            if not connection and self.ejection_s > 0:
                self._eject(u, time.monotonic())  # (resets ``failures``: checked above, not after)
            self._set(u, False)

    def _eject(self, u: Upstream, now: float) -> None:
        if now - u.last_ejection > self.ejection_max_s:
            u.ejections = 0  # the last ejection is long past: start over from ejection_s
        u.ejections += 1
        u.last_ejection = now
        span = min(self.ejection_s * 2 ** (u.ejections - 1), self.ejection_max_s)
        u.ejected_until = now + span
        u.failures = 0
        log.warning(
            "instance ejected after failed requests",
            extra={"instance": u.name, "ejected_s": round(span, 3), "ejections": u.ejections},
        )
        if self.on_eject is not None:
            self.on_eject(u.name, span)

    def record_success(self, name: str) -> None:
        u = self.upstreams.get(name)
        if u is None:
            return
        if self.board is not None and (u.failures or self.board.failures(name)):
            with self._edit(u):
                u.failures = 0
        u.failures = 0

    # ------------------------------------------------------------------ active checks
    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        await asyncio.gather(*(self._check(u) for u in self.upstreams.values()))
        self._tasks = [asyncio.create_task(self._health_loop(), name="health")]
        if self.scrape_engines:
            self._tasks.append(asyncio.create_task(self._metrics_loop(), name="engine-metrics"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check(u) for u in list(self.upstreams.values())))

    async def _check(self, u: Upstream) -> None:
        assert self._session is not None
        url = (u.cfg.url or "").rstrip("/")
        limit = max(0.5, self.health_interval_s * 2)
        timeout = aiohttp.ClientTimeout(total=limit)
        ok = timed_out = False
        mark = self.lag.mark() if self.lag is not None else 0.0
        try:
            async with self._session.get(f"{url}/health", timeout=timeout) as r:
                ok = r.status == 200
        except TimeoutError:  # (before ClientError: aiohttp's ServerTimeoutError is both)
            timed_out = True
        except aiohttp.ClientError:
            ok = False
        if timed_out and self.lag is not None and self.lag.stalled(mark, limit):
            # This process stood still for much of the wait (a collection, its own overload, the
            # machine's other processes): the answer may well be waiting in the socket.  No verdict.
            u.last_check = time.monotonic()
            return
        u.check_timeouts = u.check_timeouts + 1 if timed_out else 0
        if timed_out and u.healthy and u.check_timeouts < self.health_timeouts:
            # No answer yet is not "down": a busy API server answers late.  The next check decides,
            # and a request that fails meanwhile takes the instance out through the passive checks.
            u.last_check = time.monotonic()
            return
        if ok:
            # /health decides rotation; the model list is refreshed when it can be.  A slow or failing
            # /v1/models (a busy API server) keeps the models learnt last rather than taking a healthy
            # instance out of rotation.
            try:
                async with self._session.get(f"{url}/v1/models", timeout=timeout) as r:
                    if r.status == 200:
                        learn_models(u, await r.json())
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
                log.debug("model list not refreshed", extra={"instance": u.name})
        u.last_check = now = time.monotonic()
        with self._edit(u):
            if not ok:
                # The instance says it is down itself (a crash, a restart, a dead engine): that explains its
                # failed requests, and the first passing check puts it back, as after connection errors.
                # A passing check proves nothing about requests: only a successful one resets ``failures``.
                u.failures = 0
                u.ejected_until = 0.0
            self._set(u, ok and now >= u.ejected_until)

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(u) for u in list(self.upstreams.values()) if u.healthy))
            await asyncio.sleep(self.metrics_interval_s)

    async def _scrape(self, u: Upstream) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{(u.cfg.url or '').rstrip('/')}/metrics", timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return
        running, waiting, kv = parse_engine_load(text)
        now = time.monotonic()
        for t in u.targets():
            rank = str(t.dp_rank)
            self.load.observe_engine(
                t.key, int(running.get(rank, 0)), int(waiting.get(rank, 0)), now, kv.get(rank, 0.0)
            )


def learn_models(u: Upstream, listing: object) -> None:
    """What an instance's ``/v1/models`` says it serves: every model id, and which are LoRA adapters (a
    card with a ``parent``: the model it adapts).  Adapters load and unload at run time: each health check
    reads the list again."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return
    cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    u.served_models = [m["id"] for m in cards]
    u.adapters = {m["id"]: m["parent"] for m in cards if isinstance(m.get("parent"), str)}


def parse_engine_load(text: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """vllm:num_requests_running / waiting and vllm:kv_cache_usage_perc (a 0-1 fraction;
    vllm:gpu_cache_usage_perc before vLLM 0.13) per engine (data-parallel rank) from /metrics text."""
    running: dict[str, float] = {}
    waiting: dict[str, float] = {}
    kv: dict[str, float] = {}
    names = {
        "vllm:num_requests_running": running,
        "vllm:num_requests_waiting": waiting,
        "vllm:kv_cache_usage_perc": kv,
        "vllm:gpu_cache_usage_perc": kv,
    }
    try:
        for fam in text_string_to_metric_families(text):
            dest = names.get(fam.name)
            if dest is None:
                continue
            for s in fam.samples:
                eng = s.labels.get("engine", "0")
                # Requests add up over an engine's samples; a usage fraction is a level (the highest).
                prev = dest.get(eng, 0.0)
                dest[eng] = max(prev, s.value) if dest is kv else prev + s.value
    except (ValueError, TypeError):
        pass
    return running, waiting, kv
