"""A simulated vLLM fleet in one process and one event loop, and the fleet file that describes it::

    async with SimFleet(SimFleetConfig(instances=4, dp_size=2)) as fleet:
        fleet.urls                  # ["http://127.0.0.1:P", ...]
        fleet.fleet_config()        # indexer.config.FleetConfig of the running fleet
        fleet.write_fleet_file(path)
        await fleet.servers[0].crash(down_s=1.0)

Ports, from ``base_port`` (0: a free block below 32768 is found), ``stride = 1 + 2 x dp_size`` per
instance: HTTP at ``base + i*stride``, PUB at ``+ 1`` and ROUTER at ``+ 1 + dp`` (rank r: ``+ r`` on
both, vLLM's data-parallel offset).

Everything shares one tokenizer (loaded once, off the event loop), one answer vocabulary and one ZeroMQ
context.  ``start()`` returns only once every instance answers ``/health``; the fleet file is only ever
written from a started fleet, atomically.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml
import zmq.asyncio

from indexer.config import FleetConfig
from kvrouter.lab.sim.engine.engine import CacheConfig, EngineConfig
from kvrouter.lab.sim.engine.scheduler import SchedulerConfig
from kvrouter.lab.sim.engine.shared_store import SharedStore
from kvrouter.lab.sim.engine.tiers import tiers_config
from kvrouter.lab.sim.engine.timing import get_profile
from kvrouter.lab.sim.errors import SimConfigError, SimError
from kvrouter.lab.sim.server.answers import AnswerVocab
from kvrouter.lab.sim.server.faults import FaultConfig
from kvrouter.lab.sim.server.instance import DEFAULT_PROFILE, SimInstance, SimInstanceConfig
from kvrouter.lab.sim.server.kv_transfer import KvTransferConfig
from kvrouter.lab.sim.server.server import SimServer
from kvrouter.lab.sim.server.tokenizer import load_sim_tokenizer
from kvrouter.routing import disagg
from kvrouter.types import Role
from tokenizer_cache import CachedTokenizer, default_tokenizer_path


def parse_roles(spec: str) -> list[Role]:
    """``routing.disagg.parse_roles``, refusing a bad spec with ``SimConfigError``."""
    try:
        return disagg.parse_roles(spec)
    except ValueError as e:
        raise SimConfigError(str(e)) from None


_PORT_RANGE = (20000, 32000)
"""Where free ports are looked for: below Linux's ephemeral range, where a ZeroMQ socket reconnecting to a
closed port can connect to itself."""
PORT_RANGE_ENV = "KVROUTER_PORT_RANGE"
"""``lo-hi`` within ``_PORT_RANGE``: where this process (and what it starts) looks instead.  Parallel test
workers each get a slice of their own (tests/conftest.py), so one never takes a port another has just
found free and not yet bound."""


def port_range() -> tuple[int, int]:
    """``_PORT_RANGE``, or the slice ``KVROUTER_PORT_RANGE`` names (ignored unless well formed, inside it
    and at least 200 ports wide)."""
    lo, _, hi = os.environ.get(PORT_RANGE_ENV, "").partition("-")
    if lo.isdigit() and hi.isdigit():
        a, b = int(lo), int(hi)
        if _PORT_RANGE[0] <= a and a + 200 <= b <= _PORT_RANGE[1]:
            return a, b
    return _PORT_RANGE


class SimFleetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    instances: int = 2
    """Number of instances."""
    name_prefix: str = "sim"
    """Instance i is named ``<prefix>-<i>``."""
    host: str = "127.0.0.1"
    """Interface every server and socket binds."""
    base_port: int = 0
    """First port of the layout above; 0: a free block is found."""
    dp_size: int = 1
    """Data-parallel ranks per instance."""
    model: str = "sim-model"
    """Served model name."""
    lora_names: list[str] = []
    """LoRA adapters served from the start besides the model."""
    runtime_lora: bool | None = None
    """Serve runtime adapter loading; None: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` decides."""
    responses_store: bool | None = None
    """Store Responses API answers; None: ``VLLM_ENABLE_RESPONSES_API_STORE`` decides."""
    pooling: bool = False
    """Also serve the pooling, scoring and transcription routes."""
    profile: str = DEFAULT_PROFILE
    """Timing profile (``kvrouter.lab.sim.engine.timing.PROFILES``)."""
    profiles: list[str] = []
    """A mixed fleet: instance i's timing profile (empty: every instance ``profile``).  The fleet file
    does not say which is which: the router learns each instance's speed from its answers."""
    speed: float = 1.0
    """Run this many times faster than the modelled hardware."""
    capacity_blocks: int | None = None
    """KV capacity per rank in blocks; None: the profile's."""
    block_size: int = 16
    """Tokens per KV block."""
    cpu_offload_blocks: int = 0
    """CPU offload tier per rank, in blocks (0: none)."""
    shared_l2_blocks: int = 0
    """A store every rank of every instance attaches (``sim.engine.shared_store``), in blocks (0: none);
    the fleet file declares it (``tiers.shared``)."""
    shared_l2_gbps: float = 12.5
    """Its load bandwidth into a rank, GB/s."""
    max_num_seqs: int = 256
    """vLLM ``--max-num-seqs``."""
    max_num_batched_tokens: int = 8192
    """vLLM ``--max-num-batched-tokens``."""
    max_model_len: int | None = None
    """vLLM ``--max-model-len``; None: the profile's context, capped by the KV capacity."""
    release: str = "0.33.0"
    """vLLM release whose KV-event wire format is published."""
    events: bool = True
    """Publish KV events."""
    replay: bool = True
    """Serve replay (needs ``events``)."""
    topic: str = ""
    """Frame 0 of every event message."""
    bind: str | None = None
    """Bind mode: the indexer binds a SUB here and every publisher connects to it (topic
    ``kv@<name>@<model>``; dp_size 1 only).  Written as the fleet file's ``bind``."""
    tokenizer: str | None = None
    """Tokenizer directory or cached hub name; None: ``tokenizer_cache.default_tokenizer_path()``."""
    chat_template: str | None = None
    """Chat template (file or Jinja text); None: the tokenizer's, or the simulator's if it has none."""
    answer_tokens: int = 256
    """Mean answer length when ending with EOS (0: answers run to max_tokens)."""
    seed: int = 0
    """Seed of answers and drop faults (instance i uses seed + i)."""
    faults: FaultConfig = FaultConfig()
    """Faults every instance starts with."""
    health_timeout_s: float = 30.0
    """How long ``start()`` waits for every ``/health`` to answer 200."""
    roles: list[Role] = []
    """A disaggregated fleet: instance i's role (``parse_roles``), written to the fleet file; its name is
    then ``<prefix>-<role>-<n>`` (n counting within the role).  Empty: every instance ``both``."""
    kv_transfer: KvTransferConfig = KvTransferConfig()
    """Every instance's simulated KV connector (transfer bandwidth, lease)."""

    def validate(self) -> None:
        if self.instances < 1:
            raise SimConfigError("instances must be >= 1")
        if self.roles and len(self.roles) != self.instances:
            raise SimConfigError(f"{len(self.roles)} roles for {self.instances} instances")
        if self.profiles and len(self.profiles) != self.instances:
            raise SimConfigError(f"{len(self.profiles)} profiles for {self.instances} instances")
        if self.base_port < 0 or self.base_port + self.instances * self.stride > 65536:
            raise SimConfigError("the port layout does not fit below 65536")
        if self.replay and not self.events:
            raise SimConfigError("replay needs events")
        if self.shared_l2_blocks < 0 or self.shared_l2_gbps <= 0:
            raise SimConfigError("shared_l2_blocks must be >= 0 and shared_l2_gbps positive")
        for cfg in self.instance_configs(self.base_port or port_range()[0]):
            cfg.validate()

    @property
    def stride(self) -> int:
        return 1 + 2 * self.dp_size

    def instance_configs(self, base_port: int) -> list[SimInstanceConfig]:
        engine = EngineConfig(
            profile=self.profile,
            speed=self.speed,
            cache=CacheConfig(
                block_size=self.block_size,
                num_gpu_blocks=self.capacity_blocks,
                cpu_offload_blocks=self.cpu_offload_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
        )
        out = []
        seen: dict[str, int] = {}
        profiles = self.profiles or [self.profile] * self.instances
        for i in range(self.instances):
            b = base_port + i * self.stride
            name = f"{self.name_prefix}-{i}"
            role: Role = "both"
            if self.roles:
                role = self.roles[i]
                name = f"{self.name_prefix}-{role}-{seen.get(role, 0)}"
                seen[role] = seen.get(role, 0) + 1
            out.append(
                SimInstanceConfig(
                    name=name,
                    host=self.host,
                    port=b,
                    events_port=b + 1 if self.events else None,
                    replay_port=b + 1 + self.dp_size if self.replay else None,
                    dp_size=self.dp_size,
                    model=self.model,
                    lora_names=self.lora_names,
                    runtime_lora=self.runtime_lora,
                    responses_store=self.responses_store,
                    pooling=self.pooling,
                    engine=msgspec.structs.replace(engine, profile=profiles[i]),
                    release=self.release,
                    topic=self.topic,
                    connect_endpoint=self.bind,
                    answer_tokens=self.answer_tokens,
                    seed=self.seed + i,
                    faults=self.faults,
                    role=role,
                    kv_transfer=self.kv_transfer,
                )
            )
        return out


def free_port_block(n: int, host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A base port p such that p .. p + n - 1 are all free now (below 32768)."""
    rng = rng or random.Random()
    lo, hi = port_range()
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise SimError(f"no block of {n} free ports in {lo}..{hi}")


class SimFleet:
    """N simulated instances in this process.  ``start()``/``stop()`` or ``async with``."""

    def __init__(
        self,
        config: SimFleetConfig | None = None,
        *,
        tokenizer: CachedTokenizer | None = None,
        chat_template: str | None = None,
    ) -> None:
        """``tokenizer``: share one already loaded (loading takes seconds; the fleet does not close it),
        with ``chat_template``, the template it was built with beyond its own (``load_sim_tokenizer``'s
        second result), for the fleet file.  Without ``tokenizer``, ``config.tokenizer`` is loaded."""
        self.config = config or SimFleetConfig()
        self.config.validate()
        self._tokenizer = tokenizer
        self._own_tokenizer = tokenizer is None
        self.chat_template: str | None = chat_template
        """The chat template the instances apply beyond the tokenizer's own (written to the fleet file)."""
        self.servers: list[SimServer] = []
        self._zmq: zmq.asyncio.Context | None = None
        c = self.config
        self.shared_store = (
            SharedStore(c.shared_l2_blocks, c.block_size, c.shared_l2_gbps * 1e9)
            if c.shared_l2_blocks
            else None
        )
        """The L2 every instance attaches (None without one); it outlives restarts of instances."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        if self._tokenizer is None:
            path = cfg.tokenizer or default_tokenizer_path()
            self._tokenizer, self.chat_template = await loop.run_in_executor(
                None, load_sim_tokenizer, path, cfg.chat_template
            )
        tok = self.tokenizer
        vocab = await loop.run_in_executor(None, AnswerVocab.from_tokenizer, tok)
        self._zmq = zmq.asyncio.Context()
        base = cfg.base_port or free_port_block(cfg.instances * cfg.stride, cfg.host)
        try:
            for icfg in cfg.instance_configs(base):
                inst = SimInstance(
                    icfg,
                    tok,
                    vocab=vocab,
                    zmq_ctx=self._zmq,
                    chat_template=self.chat_template,
                    shared=self.shared_store,
                )
                server = SimServer(inst)
                self.servers.append(server)
                await server.start()
            await self.wait_healthy(cfg.health_timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every instance (idempotent).  Nothing keeps running, no socket stays open."""
        servers, self.servers = self.servers, []
        for s in servers:
            await s.stop()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        if self._own_tokenizer and self._tokenizer is not None:
            self._tokenizer.close()
            self._tokenizer = None

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Return once every instance answers ``GET /health`` with 200.  Raises ``SimError``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        pending = list(self.servers)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while pending:
                still = []
                for s in pending:
                    try:
                        async with session.get(f"{s.url}/health") as r:
                            if r.status != 200:
                                still.append(s)
                    except (aiohttp.ClientError, TimeoutError):
                        still.append(s)
                pending = still
                if pending:
                    if asyncio.get_running_loop().time() > deadline:
                        raise SimError(f"not healthy after {timeout_s} s: {[s.name for s in pending]}")
                    await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ description
    @property
    def tokenizer(self) -> CachedTokenizer:
        if self._tokenizer is None:
            raise SimError("the fleet is not started")
        return self._tokenizer

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def server(self, name: str) -> SimServer:
        for s in self.servers:
            if s.name == name:
                return s
        raise KeyError(name)

    def fleet_dict(self) -> dict[str, Any]:
        """The fleet file's content: ``indexer.config.FleetConfig``'s schema, plus
        ``models.<name>.chat_template`` (the gateway's ``ModelConfig``) when the instances apply a template
        the tokenizer does not carry."""
        if not self.servers:
            raise SimError("the fleet is not started")
        cfg = self.config
        instances = []
        for s in self.servers:
            ic = s.instance.config
            entry: dict[str, Any] = {"name": ic.name, "url": s.url}
            if ic.events_endpoint is not None:
                entry["events"] = ic.events_endpoint
            if ic.replay_endpoint is not None:
                entry["replay"] = ic.replay_endpoint
            if ic.topic:
                entry["topic"] = ic.topic
            entry["dp_size"] = ic.dp_size
            entry["models"] = [ic.model]  # adapters come and go: the gateway learns them from /v1/models
            if ic.role != "both":
                entry["role"] = ic.role
            instances.append(entry)
        out: dict[str, Any] = {
            "block_size": cfg.block_size,
            "tokenizer": cfg.tokenizer or default_tokenizer_path(),
            "instances": instances,
        }
        if cfg.bind is not None:
            out["bind"] = cfg.bind
        if cfg.shared_l2_blocks:
            tiers = tiers_config(get_profile(cfg.profile), cfg.shared_l2_blocks, cfg.shared_l2_gbps)
            out["tiers"] = msgspec.to_builtins(tiers)
        if self.chat_template is not None:
            out["models"] = {cfg.model: {"chat_template": self.chat_template}}
        return out

    def fleet_config(self) -> FleetConfig:
        fleet = msgspec.convert(self.fleet_dict(), FleetConfig)
        fleet.validate()
        return fleet

    def fleet_yaml(self) -> str:
        return yaml.safe_dump(self.fleet_dict(), sort_keys=False, allow_unicode=True)

    def write_fleet_file(self, path: str | Path) -> Path:
        """Write the fleet file atomically (a reader never sees a partial file)."""
        path = Path(path)
        text = self.fleet_yaml()
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a fleet file holds no secret
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path
