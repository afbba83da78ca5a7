"""The simulated NIXL connector of one instance (vLLM 0.33, pull mode, ``kv_role: kv_both``): the
prefill side holds a finished prefill leg's blocks under a lease, the decode side pulls them.

::

    prefill leg finishes ──held()──▶ lease (lease_s) ──expires──▶ blocks freed
                                       ▲                │ kv_transfer_params (api.kv_transfer) in the answer
                                       │ POST /sim/kv/read (remote_host:remote_port, the side channel)
    decode leg admitted ──KvLoad──▶ pull: latency + tokens x KV bytes / bandwidth ──read──▶ finish_load(ok)

The side channel is the prefill instance's own HTTP server (``remote_port`` is its HTTP port, where
vLLM's is NIXL's): a read succeeds only if that instance is up, its engine is the one that computed the
blocks (``remote_engine_id`` changes when it restarts) and the lease still holds; it frees the blocks, as
the decode instance's notification does in vLLM.  A failed read leaves the decode instance to compute
what did not arrive.  Time runs as the engine's: divided by ``speed``, multiplied by ``slowdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from typing import Any

import aiohttp
import msgspec

from kvrouter.api.kv_transfer import DecodeRequestParams, PrefillAnswerParams
from kvrouter.lab.sim.engine.scheduler import KvLoad
from kvrouter.lab.sim.errors import SimConfigError
from kvrouter.lab.sim.server.faults import FaultState
from kvrouter.lab.sim.server.rank import EngineRank

log = logging.getLogger("kvrouter.lab.sim.server.kv_transfer")


class KvTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = True
    """Honour ``kv_transfer_params`` (vLLM started with the NIXL connector); off: ignore them and answer
    ``kv_transfer_params: null``, as vLLM without a KV connector."""
    bandwidth_bytes_per_s: float = 50e9
    """KV-cache transfer bandwidth into this instance (400 Gb/s RDMA by default, as ``kvrouter eval``)."""
    latency_s: float = 0.002
    """Fixed cost of one transfer (handshake, notification)."""
    lease_s: float = 30.0
    """How long a prefill instance holds blocks nobody reads (vLLM's ``kv_lease_duration``, default 30)."""

    def validate(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0 or self.lease_s <= 0:
            raise SimConfigError("kv_transfer: bandwidth and lease must be > 0, latency >= 0")


class ReadRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /sim/kv/read``: which held blocks a decode instance has read."""

    remote_engine_id: str
    remote_request_id: str


class KvTransferAgent:
    """Leases and pulls of one instance (one event loop, like the rest of it)."""

    def __init__(
        self,
        name: str,
        host: str,
        ranks: list[EngineRank],
        faults: FaultState,
        config: KvTransferConfig,
        *,
        num_gpus: int = 1,
    ) -> None:
        self.name = name
        self.host = host
        self.port = 0
        """The HTTP port (the side channel), set once the server is listening."""
        self.ranks = ranks
        self.faults = faults
        self.config = config
        self.num_gpus = num_gpus
        self.engine_ids: list[str] = []
        self._leases: dict[tuple[int, str], asyncio.TimerHandle] = {}
        self._pulls: dict[str, DecodeRequestParams] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self.stats = {"pulled": 0, "pull_failed": 0, "read": 0, "read_refused": 0, "expired": 0}
        self.recent_reads: deque[str] = deque(maxlen=64)
        """The request ids of the last blocks read here (which decode legs pulled what)."""
        self.reset()

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """A (re)start: new engine ids, so reads of blocks computed before it are refused."""
        for h in self._leases.values():
            h.cancel()
        self._leases.clear()
        self._pulls.clear()
        self.engine_ids = [f"{self.name}-dp{r}-{uuid.uuid4().hex[:12]}" for r in range(len(self.ranks))]

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.reset()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ prefill side
    def held(self, rank: EngineRank, request_id: str, cached_tokens: int) -> dict[str, Any] | None:
        """A prefill leg finished holding its blocks: lease them and return its ``kv_transfer_params``
        (None if it holds none: it was aborted, or the engine restarted)."""
        held = rank.engine.held(request_id)
        if held is None:
            return None
        blocks, tokens = held
        key = (rank.rank, request_id)
        loop = asyncio.get_running_loop()
        self._leases[key] = loop.call_later(self.config.lease_s, self._expire, rank, request_id)
        params = PrefillAnswerParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=[[int(b) for b in blocks]],
            remote_engine_id=self.engine_ids[rank.rank],
            remote_request_id=request_id,
            remote_host=self.host,
            remote_port=self.port,
            tp_size=self.num_gpus,
            dcp_size=1,
            pp_size=1,
            remote_num_tokens=tokens,
            remote_blocks_expiry_time=None,
            remote_registration_generation=0,
            transfer_mode="pull",
            remote_prefill_cached_tokens=cached_tokens,
        )
        out: dict[str, Any] = msgspec.to_builtins(params)
        return out

    def _expire(self, rank: EngineRank, request_id: str) -> None:
        self._leases.pop((rank.rank, request_id), None)
        if rank.engine.release_held(request_id):
            self.stats["expired"] += 1
            log.info("held blocks expired unread", extra={"instance": self.name, "request": request_id})
            rank.wake()

    def read(self, req: ReadRequest) -> bool:
        """A decode instance read these blocks: free them.  False: unknown engine or request (restarted,
        expired, read already)."""
        try:
            r = self.engine_ids.index(req.remote_engine_id)
        except ValueError:
            self.stats["read_refused"] += 1
            return False
        rank = self.ranks[r]
        lease = self._leases.pop((r, req.remote_request_id), None)
        if lease is not None:
            lease.cancel()
        if not rank.engine.release_held(req.remote_request_id):
            self.stats["read_refused"] += 1
            return False
        self.stats["read"] += 1
        self.recent_reads.append(req.remote_request_id)
        rank.wake()
        return True

    # ------------------------------------------------------------------ decode side
    def expect(self, request_id: str, params: DecodeRequestParams) -> None:
        """A decode leg entered the engine; its transfer starts when the engine admits it."""
        self._pulls[request_id] = params

    def forget(self, request_id: str) -> None:
        self._pulls.pop(request_id, None)

    def on_loads(self, rank: EngineRank, loads: list[KvLoad]) -> None:
        """The engine admitted decode legs: start their pulls (called by the rank's loop)."""
        for load in loads:
            params = self._pulls.pop(load.request_id, None)
            if params is None:
                continue
            t = asyncio.create_task(self._pull(rank, load, params), name=f"kv-pull:{load.request_id}")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def transfer_s(self, rank: EngineRank, tokens: int) -> float:
        """Modelled duration of pulling ``tokens`` tokens' KV cache into ``rank``."""
        kv_bytes = tokens * rank.engine.profile.kv_bytes_per_token
        t = self.config.latency_s + kv_bytes / self.config.bandwidth_bytes_per_s
        return t / rank.engine.config.speed * self.faults.slowdown

    async def _pull(self, rank: EngineRank, load: KvLoad, params: DecodeRequestParams) -> None:
        epoch = rank.epoch
        if load.tokens:
            await asyncio.sleep(self.transfer_s(rank, load.tokens))
        ok = await self._read_remote(params)
        self.stats["pulled" if ok else "pull_failed"] += 1
        if not ok:
            log.warning(
                "KV transfer failed: computing the prompt locally",
                extra={"instance": self.name, "request": load.request_id, "from": params.remote_engine_id},
            )
        if load.tokens and rank.epoch == epoch and rank.engine.finish_load(load.request_id, ok):
            rank.wake()

    async def _read_remote(self, params: DecodeRequestParams) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        url = f"http://{params.remote_host}:{params.remote_port}/sim/kv/read"
        body = {"remote_engine_id": params.remote_engine_id, "remote_request_id": params.remote_request_id}
        try:
            async with self._session.post(url, json=body) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def state(self) -> dict[str, Any]:
        return {
            "engine_ids": self.engine_ids,
            "leases": len(self._leases),
            "pulls_in_flight": len(self._tasks),
            "recent_reads": list(self.recent_reads),
            **self.stats,
        }
