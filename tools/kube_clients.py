"""Three async Kubernetes clients (lightkube, kr8s, kubernetes-asyncio) measured on the work discovery does:
import, a paged LIST of pods, then a WATCH from an older version that replays changes, against the fake API
server of the tests (tests/support/fake_apiserver.py) on 127.0.0.1.

Each client lives in its own virtualenv (they cannot share one with kvrouter: different HTTP stacks and
pins), made on first use under ``--venvs`` with pip from PyPI::

    .venv/bin/python tools/kube_clients.py --pods 2000 --events 2000 --runs 3 [--json out.json]

The parent (this file, run with kvrouter's venv) serves the fake and seeds it; a child per client and run
(``python tools/kube_clients.py --child CLIENT ...``, the client's venv) imports the client, lists, watches,
and prints one JSON line: import time and RSS growth, LIST and WATCH wall and CPU time, peak RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = {
    "lightkube": ["lightkube==1.0.1"],
    "lightkube-structs": ["lightkube==1.0.1"],
    "kr8s": ["kr8s==0.20.15"],
    "kubernetes-asyncio": ["kubernetes-asyncio==36.1.0"],
}
COMMON = ["aiohttp", "msgspec"]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ------------------------------------------------------------------------------------------------ child
# The fields of a Pod that discovery reads (kvrouter.membership.pods), for lightkube-structs.
class Meta(msgspec.Struct, frozen=True, rename="camel"):
    name: str = ""
    namespace: str = ""
    resource_version: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    deletion_timestamp: str | None = None

    @property
    def resourceVersion(self) -> str:
        return self.resource_version


class Port(msgspec.Struct, frozen=True, rename="camel"):
    name: str | None = None
    container_port: int = 0


class Container(msgspec.Struct, frozen=True):
    name: str = ""
    ports: list[Port] | None = None


class Spec(msgspec.Struct, frozen=True):
    containers: list[Container] | None = None


class Cond(msgspec.Struct, frozen=True):
    type: str = ""
    status: str = ""


class Status(msgspec.Struct, frozen=True):
    phase: str = ""
    pod_ip: str | None = msgspec.field(default=None, name="podIP")
    conditions: list[Cond] | None = None


def _struct_pod() -> Any:
    """A Pod resource as kvrouter.membership.kube defines it (msgspec types plus lightkube's API info),
    rebuilt here: the client's virtualenv has no kvrouter."""
    from lightkube.core.resource import ApiInfo, NamespacedResourceG, ResourceDef

    class Pod(msgspec.Struct, NamespacedResourceG, frozen=True):
        metadata: Meta = Meta()
        spec: Spec = Spec()
        status: Status = Status()
        _api_info = ApiInfo(ResourceDef("", "v1", "Pod"), "pods", ["list", "watch"])

    return Pod


async def _child(client: str, url: str, rv0: str, n_events: int, page: int) -> dict[str, Any]:
    import importlib

    out: dict[str, Any] = {"client": client}
    rss0, t0 = _rss_mib(), time.perf_counter()
    mods = {
        "lightkube": ["lightkube", "lightkube.resources.core_v1", "lightkube.generic_resource"],
        "lightkube-structs": ["lightkube"],
        "kr8s": ["kr8s.asyncio", "kr8s.asyncio.objects"],
        "kubernetes-asyncio": ["kubernetes_asyncio.client", "kubernetes_asyncio.watch"],
    }[client]
    for m in mods:
        importlib.import_module(m)
    out["import_ms"] = (time.perf_counter() - t0) * 1000
    out["import_rss_mib"] = _rss_mib() - rss0
    names: list[str] = []
    events = 0

    def clock() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    if client.startswith("lightkube"):
        from lightkube import AsyncClient, KubeConfig
        from lightkube.config.models import Cluster, User

        if client == "lightkube":
            from lightkube.resources.core_v1 import Pod
        else:  # decoded straight into msgspec types, as discovery does (the fields it reads)
            Pod = _struct_pod()  # type: ignore[misc]

        cfg = KubeConfig.from_one(cluster=Cluster(server=url), user=User(token="t"), namespace="default")
        api = AsyncClient(cfg)
        w0, c0 = clock()
        it = api.list(Pod, namespace="default", chunk_size=page, labels={"app": "vllm"})
        async for p in it:
            names.append(p.metadata.name)
        w1, c1 = clock()
        async for _typ, _obj in api.watch(
            Pod, namespace="default", labels={"app": "vllm"}, resource_version=rv0
        ):
            events += 1
            if events == n_events:
                break
        w2, c2 = clock()
        await api.close()
    elif client == "kr8s":
        import kr8s.asyncio
        from kr8s.asyncio.objects import Pod as KPod

        os.environ["KUBECONFIG"] = str(Path(os.environ["KC_DIR"]) / "config")
        api = await kr8s.asyncio.api()
        w0, c0 = clock()
        async for p in api.async_get(KPod, namespace="default", label_selector={"app": "vllm"}):
            names.append(p.metadata.name)
        w1, c1 = clock()
        async for _typ, _obj in api.async_watch(
            KPod, namespace="default", label_selector="app=vllm", since=rv0
        ):
            events += 1
            if events == n_events:
                break
        w2, c2 = clock()
    else:
        from kubernetes_asyncio import client as k
        from kubernetes_asyncio import watch as kw

        conf = k.Configuration(host=url, api_key={"authorization": "Bearer t"})
        async with k.ApiClient(conf) as ac:
            v1 = k.CoreV1Api(ac)
            w0, c0 = clock()
            cont = None
            while True:
                pl = await v1.list_namespaced_pod(
                    "default", label_selector="app=vllm", limit=page, _continue=cont
                )
                names.extend(p.metadata.name for p in pl.items)
                cont = pl.metadata._continue
                if not cont:
                    break
            w1, c1 = clock()
            w = kw.Watch()
            async for _ev in w.stream(
                v1.list_namespaced_pod, "default", label_selector="app=vllm", resource_version=rv0
            ):
                events += 1
                if events == n_events:
                    w.stop()
                    break
            w2, c2 = clock()
    out.update(
        listed=len(names),
        events=events,
        list_ms=(w1 - w0) * 1000,
        list_cpu_ms=(c1 - c0) * 1000,
        watch_ms=(w2 - w1) * 1000,
        watch_cpu_ms=(c2 - c1) * 1000,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    return out


# ------------------------------------------------------------------------------------------------ parent
def _venv(base: Path, client: str) -> Path:
    name = client.split("-structs")[0]
    py = base / name / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(base / name)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *CLIENTS[client], *COMMON], check=True)
    return py


async def _parent(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT))
    from tests.support.fake_apiserver import FakeApiServer, make_pod
    from tests.support.net import free_port

    api = FakeApiServer()
    url = await api.start(free_port())
    for i in range(args.pods):
        api.put(make_pod(f"vllm-{i}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", labels={"app": "vllm"}))
    rv0 = str(api.rv)
    for i in range(args.events):  # readiness flapping: the history a watch from rv0 replays
        j = i % args.pods
        ip = f"10.{j // 65536}.{j // 256 % 256}.{j % 256}"
        api.put(make_pod(f"vllm-{j}", ip, labels={"app": "vllm"}, ready=i % 2 == 1))
    kc = Path(args.venvs) / "kubeconfig"
    kc.mkdir(parents=True, exist_ok=True)
    (kc / "config").write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "default"}}
                ],
                "current-context": "fake",
            }
        )
    )
    results: list[dict[str, Any]] = []
    try:
        for client in args.clients:
            py = _venv(Path(args.venvs), client)
            for _ in range(args.runs):
                cmd = [str(py), __file__, "--child", client, "--url", url, "--rv0", rv0]
                cmd += ["--events", str(args.events), "--page", str(args.page)]
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdout=asyncio.subprocess.PIPE, env={**os.environ, "KC_DIR": str(kc)}
                )
                out, _ = await asyncio.wait_for(proc.communicate(), 300)
                if proc.returncode != 0:
                    results.append({"client": client, "error": f"exit {proc.returncode}"})
                    continue
                results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        await api.stop()
    return results


def _summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = (
        "import_ms",
        "import_rss_mib",
        "list_ms",
        "list_cpu_ms",
        "watch_ms",
        "watch_cpu_ms",
        "peak_rss_mib",
    )
    out = []
    for client in dict.fromkeys(r["client"] for r in results):
        ok = [r for r in results if r["client"] == client and "error" not in r]
        row: dict[str, Any] = {"client": client, "runs": len(ok)}
        if ok:
            row.update({k: round(statistics.median(r[k] for r in ok), 1) for k in keys})
            row["listed"], row["events"] = ok[0]["listed"], ok[0]["events"]
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=list(CLIENTS))
    p.add_argument("--url")
    p.add_argument("--rv0")
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    p.add_argument("--pods", type=int, default=2000)
    p.add_argument("--events", type=int, default=2000)
    p.add_argument("--page", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--venvs", default="/tmp/kvrouter-kube-clients")
    p.add_argument("--json", help="write the per-run results and the medians here")
    args = p.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(args.child, args.url, args.rv0, args.events, args.page))))
        return
    results = asyncio.run(_parent(args))
    summary = _summary(results)
    for row in summary:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "runs": results, "median": summary}, indent=1)
        )


if __name__ == "__main__":
    main()
