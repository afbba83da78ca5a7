"""The shape of the code, checked: dependencies point one way and pure parts stay pure.

- ``indexer`` and ``tokenizer_cache`` never import ``kvrouter``; ``tokenizer_cache`` never imports
  ``indexer`` and the reverse.
- Between kvrouter's subpackages (``sim`` counted as its three parts), the import graph has no cycle.
- Pure cores import no I/O library: routing, the engine model, the request/response shapes.
- No product module imports a test module or fake.
- The lab (``kvrouter.lab``: simulator, evaluation, workloads, benchmarks, reliability, reports, demo)
  depends on the router, never the other way: no module outside it imports it, and ``kvrouter serve``
  loads none of it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("indexer", "tokenizer_cache", "kvrouter")
IO_LIBS = {"asyncio", "aiohttp", "zmq", "redis", "socket", "subprocess", "lightkube", "httpx2"}


def _imports() -> dict[str, set[str]]:
    """Module -> every module it imports (absolute names, relative imports resolved)."""
    out: dict[str, set[str]] = defaultdict(set)
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mod = ".".join(parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = parts if is_pkg else parts[:-1]
                        base = base[: len(base) - (node.level - 1)]
                        target = ".".join([*base, *([node.module] if node.module else [])])
                    else:
                        target = node.module or ""
                    out[mod].add(target)
                elif isinstance(node, ast.Import):
                    out[mod].update(a.name for a in node.names)
    return out


def _unit(mod: str) -> str:
    p = mod.split(".")
    if p[0] != "kvrouter" or len(p) == 1:
        return p[0]
    if p[1] == "lab" and len(p) > 2:
        # the lab's parts are units of their own (the simulator's engine and server apart)
        if p[2] == "sim" and len(p) > 3 and p[3] in ("engine", "server"):
            return ".".join(p[:4])
        return ".".join(p[:3])
    return ".".join(p[:2])


def test_core_packages_never_import_the_router() -> None:
    for mod, targets in _imports().items():
        top = mod.split(".")[0]
        if top == "kvrouter":
            continue
        other = "indexer" if top == "tokenizer_cache" else "tokenizer_cache"
        bad = {t for t in targets if t.split(".")[0] in ("kvrouter", other, "tests")}
        assert not bad, (mod, bad)


def test_no_cycle_between_kvrouter_subpackages() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, targets in _imports().items():
        for t in targets:
            if t.split(".")[0] == "kvrouter" and _unit(t) != _unit(mod) and mod.startswith("kvrouter"):
                graph[_unit(mod)].add(_unit(t))
    for start in list(graph):
        seen, stack = set(), [start]
        while stack:
            for nxt in graph.get(stack.pop(), ()):
                assert nxt != start, f"import cycle through {start} and {nxt}"
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)


def test_pure_parts_do_no_io() -> None:
    pure = (
        "kvrouter.routing",
        "kvrouter.lab.sim.engine",
        "kvrouter.api",
        "kvrouter.types",
        "kvrouter.epp.protocol",
        "kvrouter.epp.endpoints",
        "kvrouter.epp.exchange",
        "kvrouter.membership.kubetypes",
        "kvrouter.membership.endpointslices",
        "kvrouter.membership.inferencepool",
        "kvrouter.membership.pods",
    )
    imports = _imports()
    for name in pure:  # a name that matches nothing (a module moved or renamed) checks nothing
        assert any(mod == name or mod.startswith(name + ".") for mod in imports), name
    for mod, targets in imports.items():
        if mod.startswith(pure):
            bad = {t for t in targets if t.split(".")[0] in IO_LIBS}
            assert not bad, (mod, bad)


def test_no_product_module_imports_tests() -> None:
    for mod, targets in _imports().items():
        assert not any(t.split(".")[0] == "tests" for t in targets), mod


def test_the_router_never_imports_the_lab() -> None:
    imports = _imports()
    lab = [m for m in imports if m.startswith("kvrouter.lab")]
    assert len(lab) > 50, "the lab's modules were not found where this test looks"
    for mod, targets in imports.items():
        if mod == "kvrouter.lab" or mod.startswith("kvrouter.lab."):
            continue
        bad = {t for t in targets if t == "kvrouter.lab" or t.startswith("kvrouter.lab.")}
        assert not bad, (mod, bad)


def test_serve_loads_nothing_of_the_lab() -> None:
    code = (
        "import sys; from kvrouter.cli import build_parser; build_parser(['serve', '--fleet', 'f']);"
        "print(sorted(m for m in sys.modules if m.startswith('kvrouter.lab')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_e2e_module_exists() -> None:
    from tests.conftest import E2E

    missing = [p for p in E2E if not (ROOT / p).is_file()]
    assert not missing, f"e2e modules not found (moved?): {missing}"
