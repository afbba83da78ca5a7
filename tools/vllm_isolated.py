"""Loading one vLLM release's ``kv_events.py`` on its own, without installing that vLLM (dev tool).

The module imports a handful of vLLM names that play no part in encoding events; the loader puts stand-ins
for exactly those into ``sys.modules`` while the file executes, then takes them out again:

* ``KVEventsConfig``: a record of its keyword arguments (the publisher builds one on 0.30+; the factory that
  reads it is not used);
* ``init_logger``: a standard ``logging`` logger;
* ``ExternalBlockHash`` (0.10.2+): the alias as the *same release's* ``kv_cache_utils.py`` defines it, read
  from that file, so decoding with the release's classes validates hashes as that release does;
* anything else (network helpers of 0.30+: ``get_ip`` ...): a function that raises if called.  They are
  reached only for ``tcp://*:0`` endpoints, which the recorder never uses.

Everything that shapes the bytes (the msgspec Struct classes, their options, the batch, the publisher's
encoder and ZeroMQ framing) is the release's own code.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_release_files import KV_CACHE_UTILS, KV_EVENTS, release_file


class _ConfigRecord:
    """Stand-in for ``KVEventsConfig``: keeps its keyword arguments as attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def _external_block_hash(release: str) -> Any:
    """``ExternalBlockHash`` as the release's ``kv_cache_utils.py`` spells it (e.g. ``bytes | int``)."""
    tree = ast.parse(release_file(release, KV_CACHE_UTILS).read_text())
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and target.id == "ExternalBlockHash" and value is not None:
            names = {"Union": typing.Union, "Optional": typing.Optional, "bytes": bytes, "int": int}
            return eval(compile(ast.Expression(value), "<ExternalBlockHash>", "eval"), names)
    raise LookupError(f"vLLM {release}: no ExternalBlockHash in {KV_CACHE_UTILS}")


def _refuse(name: str) -> Any:
    def stub(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"{name} is a stand-in of the golden recorder (not needed to encode events)")

    return stub


def _stand_in(release: str, name: str) -> Any:
    if name == "KVEventsConfig":
        return _ConfigRecord
    if name == "init_logger":
        return logging.getLogger
    if name == "ExternalBlockHash":
        return _external_block_hash(release)
    return _refuse(name)


def _vllm_imports(source: str) -> dict[str, list[str]]:
    """``{module: [names]}`` of the file's top-level ``from vllm... import ...`` statements."""
    out: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            out.setdefault(node.module, []).extend(a.name for a in node.names)
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            raise RuntimeError("plain 'import vllm...' in kv_events.py: extend the loader")
    return out


def load_kv_events(release: str) -> ModuleType:
    """The release's ``vllm.distributed.kv_events`` as a module named ``vllm_<release>_kv_events``."""
    path: Path = release_file(release, KV_EVENTS)
    source = path.read_text()
    stubs: dict[str, ModuleType] = {}
    for module, names in _vllm_imports(source).items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            stubs.setdefault(".".join(parts[:i]), ModuleType(".".join(parts[:i])))
        for name in names:
            setattr(stubs[module], name, _stand_in(release, name))
    name = "vllm_" + release.replace(".", "_") + "_kv_events"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    sys.modules[name] = mod  # msgspec resolves the classes' annotations through the module
    try:
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod
