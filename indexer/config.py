"""The fleet file (YAML), shared by every kvrouter command, and the indexer's part of it::

    block_size: 16
    tokenizer: /models/llama                # optional: the fleet's tokenizer (see tokenizer_cache)
    instances:
      - {name: vllm-0, url: http://vllm-0:8000, events: tcp://vllm-0:5557, events_mode: connect,
         replay: tcp://vllm-0:5558, topic: "", dp_size: 1, role: both}   # dp ranks 1.. use port+rank
    bind: tcp://10.0.0.5:5557               # optional bind mode: instances connect, topic kv@<name>@<model>
    indexer: {bind_accept: listed}          # bind mode: only the instances above may publish
    tiers: {shared: [{name: l2, medium: STORAGE, capacity_blocks: 2000000, max_age_s: 3600}]}

Decoded with msgspec (types checked, defaults in code), then ``validate()`` checks what types cannot.  The
router's settings extend this struct in ``kvrouter.config``.  A key no struct knows is refused with its
path and the nearest valid name (``parse_fleet``).  docs/configuration.md lists every field.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import yaml

from .errors import ConfigError
from .tiers import TiersConfig
from .types import SourceKey

Role = Literal["prefill", "decode", "both"]
"""An instance's job in a disaggregated (prefill/decode) fleet.  ``prefill``: it computes prompts and hands
their KV cache to a decode instance (vLLM's NIXL connector); ``decode``: it receives them and generates (and
prefills by itself the requests the router keeps whole); ``both``: either, or whole requests.  A model whose
instances are all ``both`` is routed as an aggregated fleet."""

_ENDPOINT = re.compile(r"^(tcp://[^:/]+:\d+|ipc://.+|inproc://.+)$")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's data-parallel port offset: ``tcp://host:P`` -> ``tcp://host:P+rank`` (ipc: suffix ``_rank``)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class InstanceConfig(msgspec.Struct, frozen=True):
    name: str
    """Unique name; in bind mode, the ``<instance>`` of the topic ``kv@<instance>@<model>``."""
    url: str | None = None
    """Base URL of the instance's OpenAI-compatible server."""
    events: str | None = None
    """ZeroMQ endpoint of its KV-event publisher (connect mode); without it, routed by load alone."""
    replay: str | None = None
    """ZeroMQ endpoint of its replay ROUTER (optional; vLLM always binds it)."""
    topic: str = ""
    """Subscription prefix (vLLM's ``topic``)."""
    dp_size: int = 1
    """Data-parallel ranks; rank r publishes on port + r."""
    models: list[str] = []
    """Models it serves; empty means every model of the fleet (or whatever its /v1/models says)."""
    weight: float = 1.0
    """Relative capacity, for load balancing across unequal instances."""
    role: Role = "both"
    """Its job in a disaggregated fleet (``Role``); every model it serves, unless ``model_roles`` says."""
    model_roles: dict[str, Role] = {}
    """Per served model, a role other than ``role`` (an instance that prefills one model, decodes another)."""
    events_mode: Literal["connect", "bind"] = "connect"
    """How the router reaches ``events``.  ``connect``: vLLM bound its PUB there (its endpoint is a wildcard,
    ``tcp://*:P``, or ``ipc://``) and the router connects a SUB.  ``bind``: vLLM connects its PUB out to
    ``events`` (its endpoint names a host, ``tcp://10.0.0.5:P``) and the router binds a SUB there, one per
    instance and rank, so the address must be one of the router's own."""

    def role_for(self, model: str | None) -> Role:
        """Its role for requests naming ``model`` (None: the fleet's default model)."""
        return self.model_roles.get(model, self.role) if model is not None else self.role

    def sources(self) -> list[SourceKey]:
        return [SourceKey(self.name, r) for r in range(self.dp_size)]

    def events_endpoint(self, rank: int) -> str | None:
        return None if self.events is None else offset_endpoint(self.events, rank)

    def replay_endpoint(self, rank: int) -> str | None:
        return None if self.replay is None else offset_endpoint(self.replay, rank)


class IndexerOptions(msgspec.Struct, frozen=True):
    max_blocks_per_source: int = 8_000_000
    """Cap on blocks held per (instance, rank); beyond it stores are refused and counted."""
    reserve_blocks_per_source: int = 0
    """Blocks each listed (instance, rank) is expected to hold (vLLM's GPU blocks plus its offload tiers):
    the index sizes its tables for the whole fleet at start, so it never stops to grow them (each growth
    rehashes a whole table and briefly holds it twice).  The memory is taken up front; 0: grown as needed."""
    speculative_ttl_s: float = 5.0
    """How long a speculative entry counts if no event confirms it."""
    replay_timeout_s: float = 2.0
    """A replay that has not ended by then is taken as ended (what it filled stays applied)."""
    stale_after_s: float = 600.0
    """A source disconnected this long has its blocks dropped (it shows as cold until it returns)."""
    reconnect_max_s: float = 10.0
    """Upper bound of the reconnect backoff."""
    max_pending: int = 10_000
    """Batches buffered per source while a replay runs."""
    queue_size: int = 10_000
    """Bounded per-source ingest queue: beyond it batches are dropped, counted, and recovered by replay."""
    idle_probe_s: float = 1.0
    """A connected source with a replay endpoint that has sent nothing for this long is asked for anything
    after its last batch (a replay from ``last``).  vLLM sends no heartbeat, so a lost final batch would
    otherwise stay unnoticed until the engine's next step, however long that takes.  While the source stays
    quiet it is asked again at doubling intervals (1, 2, 4 ... x this), so a batch lost after one probe is
    found by the next.  0: never."""
    idle_probe_max_s: float = 60.0
    """The longest interval between two probes of a source that stays quiet (the doubling stops here)."""
    bind_accept: Literal["any", "listed"] = "any"
    """Bind mode: which topic names create a source.  ``listed``: only the fleet's instances (an
    allow-list; others are refused and counted as ``bind_unlisted``); ``any``: every name, up to
    ``max_bind_sources`` that the fleet does not list."""
    max_bind_sources: int = 1024
    """Bind mode: sources the fleet does not list that may exist at once; further names are refused and
    counted (``bind_too_many_sources``), so a stray or hostile publisher cannot grow the index without end."""


class FleetConfig(msgspec.Struct, frozen=True):
    block_size: int = 16
    """KV-cache block size in tokens; must equal vLLM's (read from events, and a mismatch is loud)."""
    instances: list[InstanceConfig] = []
    bind: str | None = None
    """Bind mode: the indexer binds a SUB here and every instance connects, naming itself in the topic."""
    indexer: IndexerOptions = IndexerOptions()
    tokenizer: str | None = None
    """Tokenizer of the whole fleet (a local directory or a Hugging Face id in the local cache)."""
    tiers: TiersConfig = TiersConfig()
    """Offload tiers: shared stores several instances attach, and what loading from each tier costs
    (``indexer.tiers``)."""

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ConfigError("block_size must be positive")
        names = [i.name for i in self.instances]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"duplicate instance names: {sorted(dup)}")
        for inst in self.instances:
            if not inst.name or "@" in inst.name:
                raise ConfigError(f"invalid instance name {inst.name!r}")
            if inst.dp_size < 1:
                raise ConfigError(f"{inst.name}: dp_size must be >= 1")
            for ep in (inst.events, inst.replay):
                if ep is not None and not _ENDPOINT.match(ep):
                    raise ConfigError(f"{inst.name}: bad ZeroMQ endpoint {ep!r}")
            if inst.events_mode == "bind" and (inst.events is None or "*" in inst.events):
                raise ConfigError(
                    f"{inst.name}: events_mode bind needs events naming this router's address "
                    f"(where vLLM connects), got {inst.events!r}"
                )
            if inst.url is not None and not inst.url.startswith(("http://", "https://")):
                raise ConfigError(f"{inst.name}: url must be http(s)://, got {inst.url!r}")
            stray = [m for m in inst.model_roles if inst.models and m not in inst.models]
            if stray:
                raise ConfigError(f"{inst.name}: model_roles names models it does not serve: {stray}")
        if self.bind is not None and not _ENDPOINT.match(self.bind):
            raise ConfigError(f"bad bind endpoint {self.bind!r}")
        if self.indexer.idle_probe_s > 0 and self.indexer.idle_probe_max_s < self.indexer.idle_probe_s:
            raise ConfigError(
                f"indexer.idle_probe_max_s ({self.indexer.idle_probe_max_s}) must be >= indexer.idle_probe_s "
                f"({self.indexer.idle_probe_s})"
            )
        if self.indexer.max_bind_sources < 0:
            raise ConfigError("indexer.max_bind_sources must be >= 0")
        if not 0 <= self.indexer.reserve_blocks_per_source <= self.indexer.max_blocks_per_source:
            raise ConfigError(
                "indexer.reserve_blocks_per_source must be >= 0 and <= indexer.max_blocks_per_source "
                f"({self.indexer.max_blocks_per_source}), got {self.indexer.reserve_blocks_per_source}"
            )
        self.tiers.validate(names)

    def instance(self, name: str) -> InstanceConfig | None:
        return next((i for i in self.instances if i.name == name), None)


def load_yaml(path: str | Path) -> Any:
    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read fleet file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"fleet file {path} is not valid YAML: {e}") from None


_F = TypeVar("_F", bound="FleetConfig")


def _structs_in(t: msgspec.inspect.Type) -> list[msgspec.inspect.StructType]:
    """The struct types a value of type ``t`` may be (Optional and unions looked through)."""
    if isinstance(t, msgspec.inspect.StructType):
        return [t]
    if isinstance(t, msgspec.inspect.UnionType):
        return [s for u in t.types for s in _structs_in(u)]
    return []


def unknown_keys(obj: Any, t: msgspec.inspect.Type, path: str = "") -> list[str]:
    """Every key of ``obj`` (parsed YAML) that type ``t`` has no field for, anywhere in the tree, each as
    ``path.to.key`` with the nearest valid name: a misspelt key is an error, never a silent default."""
    out: list[str] = []
    structs = _structs_in(t)
    if isinstance(obj, dict) and len(structs) == 1:
        st = structs[0]
        fields = {f.encode_name: f for f in st.fields}
        for k, v in obj.items():
            where = f"{path}.{k}" if path else str(k)
            f = fields.get(k)
            if f is None:
                near = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
                out.append(where + (f" (did you mean {near[0]}?)" if near else ""))
            else:
                out += unknown_keys(v, f.type, where)
    elif isinstance(obj, list) and isinstance(t, (msgspec.inspect.ListType, msgspec.inspect.SetType)):
        for i, v in enumerate(obj):
            out += unknown_keys(v, t.item_type, f"{path}[{i}]")
    elif isinstance(obj, dict) and isinstance(t, msgspec.inspect.DictType):
        for k, v in obj.items():
            out += unknown_keys(v, t.value_type, f"{path}.{k}")
    return out


def parse_fleet(obj: Any, cls: type[_F], *, other_sections: bool = False) -> _F:
    """Type-check and validate a parsed fleet file.  Unknown keys anywhere are refused with their paths;
    ``other_sections``: top-level sections this struct does not know are left for another reader (the
    standalone indexer reads the router's fleet file)."""
    unknown = unknown_keys(obj, msgspec.inspect.type_info(cls))
    if other_sections:
        unknown = [u for u in unknown if "." in u.split(" ")[0] or "[" in u.split(" ")[0]]
    if unknown:
        raise ConfigError(
            "fleet file: unknown key" + ("s " if len(unknown) > 1 else " ") + ", ".join(unknown)
        )
    try:
        cfg = msgspec.convert(obj, cls)
    except msgspec.ValidationError as e:
        raise ConfigError(f"fleet file: {e}") from None
    cfg.validate()
    return cfg


def load_fleet(path: str | Path) -> FleetConfig:
    """Read, type-check and validate a fleet file (the router's sections, unknown here, are left alone)."""
    return parse_fleet(load_yaml(path), FleetConfig, other_sections=True)
