"""LoRA adapters across the fleet: loads and unloads passed on to the instances concerned, and adapters
loaded on demand.  Where each adapter is loaded is the pool's (``UpstreamPool.adapters``, learned from
``/v1/models`` at every health check); this keeps it current the moment the gateway itself changes it.

::

    POST /v1/load_lora_adapter     ──▶ every healthy instance (or those named in x-kvrouter-instances)
    POST /v1/unload_lora_adapter   ──▶ every instance holding it (or those named)
         all succeeded: vLLM's answer (200, its text); else the first failure as its instance answered it,
         the instance named in x-kvrouter-instance
    a request for an adapter of ``lora.adapters`` that no healthy instance holds (``lora.load_on_demand``)
         ──▶ the router's choice among the base model's instances ──load──▶ routed there
             (one load per adapter at a time: the requests that arrive meanwhile wait for it)
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec
from aiohttp import web

from ..api.errors import BadGateway, BadRequest, ServiceUnavailable
from ..api.fields import decode_object
from ..config import LoraConfig
from ..pipeline import Prepared, RequestPipeline
from .upstream import UpstreamPool

log = logging.getLogger("kvrouter.gateway.adapters")

INSTANCES_HEADER = "x-kvrouter-instances"
"""Names the instances a load or unload is for (comma-separated); default: see the module docstring."""


class AdapterManager:
    def __init__(self, pool: UpstreamPool, pipeline: RequestPipeline, cfg: LoraConfig) -> None:
        self.pool = pool
        self.pipeline = pipeline
        self.cfg = cfg
        self.session: aiohttp.ClientSession | None = None
        self.api_key: str | None = None
        self._loading: dict[str, asyncio.Task[None]] = {}
        self.loaded_on_demand = 0
        for name, a in cfg.adapters.items():
            base = a.base or next(iter(pool.models()), None)
            if base is not None:
                pool.configured_adapters[name] = base

    def base_of(self, instance: str) -> str | None:
        """The model an instance serves (what its adapters adapt)."""
        u = self.pool.upstreams.get(instance)
        if u is None:
            return None
        for m in [*u.cfg.models, *u.served_models]:
            if m not in u.adapters:
                return m
        return None

    # ------------------------------------------------------------------ passing loads and unloads on
    async def _post(self, instance: str, path: str, raw: bytes) -> tuple[int, bytes, str | None]:
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            async with self.session.post(
                self.pool.url(instance) + path,
                data=raw,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.load_timeout_s),
            ) as r:
                return r.status, await r.read(), r.headers.get("Content-Type")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise BadGateway(f"instance {instance!r} failed: {type(e).__name__}") from None

    def _named(self, request: web.Request) -> list[str] | None:
        raw = request.headers.get(INSTANCES_HEADER)
        if raw is None:
            return None
        names = [n.strip() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in self.pool.upstreams]
        if unknown:
            raise BadRequest(f"unknown instances in {INSTANCES_HEADER}: {', '.join(unknown)}")
        return names

    async def passed_on(self, request: web.Request, unload: bool) -> web.Response:
        """An operator's load or unload (an API key, or the admin token, when the fleet requires one)."""
        self.pipeline.tenant_salt(request.headers.get("Authorization"), operator=True)
        raw = await request.read()
        body = decode_object(raw)
        name = body.get("lora_name")
        targets = self._named(request)
        if targets is None:
            if unload:
                targets = self.pool.holders(name) if isinstance(name, str) else []
            else:
                targets = [u.name for u in self.pool.upstreams.values() if u.healthy and not u.draining]
        if not targets:
            if unload:  # nobody has it: vLLM's own answer for an adapter it does not hold
                msg = f"The lora adapter '{name}' cannot be found."
                return web.json_response(
                    {"error": {"message": msg, "type": "NotFoundError", "param": None, "code": 404}},
                    status=404,
                )
            raise ServiceUnavailable("no healthy instance to load the adapter onto", reason="no_target")
        path = "/v1/unload_lora_adapter" if unload else "/v1/load_lora_adapter"
        answers = await asyncio.gather(*(self._post(t, path, raw) for t in targets), return_exceptions=True)
        first_error: tuple[str, int, bytes, str | None] | None = None
        ok: tuple[int, bytes, str | None] | None = None
        for t, a in zip(targets, answers):
            if isinstance(a, BaseException):
                first_error = first_error or (t, 502, BadGateway(str(a)).body(), "application/json")
                continue
            status, data, ctype = a
            if status == 200 and isinstance(name, str):
                if unload:
                    self.pool.adapter_unloaded(t, name)
                else:
                    self.pool.adapter_loaded(t, name, self.base_of(t) or "")
                ok = ok or a
            elif first_error is None:
                first_error = (t, status, data, ctype)
        if first_error is not None:
            t, status, data, ctype = first_error
            return web.Response(
                body=data, status=status, content_type=_mime(ctype), headers={"x-kvrouter-instance": t}
            )
        assert ok is not None
        return web.Response(
            body=ok[1], status=200, content_type=_mime(ok[2]), headers={INSTANCES_HEADER: ",".join(targets)}
        )

    # ------------------------------------------------------------------ on demand
    async def ensure(self, p: Prepared) -> None:
        """Load ``p``'s adapter first if it is configured for loading on demand and no healthy instance
        has it; raises ``ServiceUnavailable`` when it cannot be loaded anywhere."""
        name = p.req.lora_name
        if name is None or not self.cfg.load_on_demand or name not in self.cfg.adapters or p.pinned:
            return
        if any(t.healthy for t in self.pool.targets(name)):
            return
        task = self._loading.get(name)
        if task is None:
            task = self._loading[name] = asyncio.create_task(self._load(p, name), name=f"lora-load:{name}")
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        await asyncio.shield(task)

    async def _load(self, p: Prepared, name: str) -> None:
        a = self.cfg.adapters[name]
        base = a.base or p.req.base_model
        d = self.pipeline.decide(p, dry_run=True, shadow=False, model=base)
        tried: set[str] = set()
        body = msgspec.json.encode({"lora_name": name, "lora_path": a.path})
        while d.chosen is not None:
            inst = d.chosen.instance
            status, data, _ = await self._post(inst, "/v1/load_lora_adapter", body)
            if status == 200 or b"already been loaded" in data:
                self.pool.adapter_loaded(inst, name, base or self.base_of(inst) or "")
                self.loaded_on_demand += 1
                log.info("adapter loaded on demand", extra={"adapter": name, "instance": inst})
                return
            log.warning("adapter load failed", extra={"adapter": name, "instance": inst, "status": status})
            tried.update(t.key for t in self.pool.instance_targets(inst) or [])
            d = self.pipeline.decide(p, tried, dry_run=True, shadow=False, model=base)
        raise ServiceUnavailable(
            f"adapter {name!r} could not be loaded on any instance", reason="adapter_load"
        )


def _mime(ctype: str | None) -> str:
    return (ctype or "text/plain").split(";")[0].strip() or "text/plain"
