"""``python -m kvrouter.lab.bench.fleet_overlay FLEET KEY=VALUE... -- ARGS``: ``kvrouter ARGS`` on a copy of
the fleet file FLEET with each dotted KEY set to VALUE (YAML), ``@fleet`` in ARGS naming the copy.

The peer harness writes the fleet file it starts a router with; the gateway benchmark changes what the
harness cannot express (token parity checks off: the fake workers' toy ``/tokenize`` disagrees with the
fleet's tokenizer, and a fleet whose parity fails is routed without token ids, so the benchmark would not
measure kv-aware routing as a fleet of real vLLM instances gets it).  The process becomes ``kvrouter``
(``exec``): the harness and the process-tree sampler see the router itself.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import yaml


def overlay(doc: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    for s in sets:
        key, _, value = s.partition("=")
        *path, last = key.split(".")
        node = doc
        for p in path:
            node = node.setdefault(p, {})
        node[last] = yaml.safe_load(value)
    return doc


def main() -> None:
    src, rest = sys.argv[1], sys.argv[2:]
    cut = rest.index("--")
    with open(src) as f:
        doc = overlay(yaml.safe_load(f) or {}, rest[:cut])
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(doc, f)
    args = [path if a == "@fleet" else a for a in rest[cut + 1 :]]
    os.execv(sys.executable, [sys.executable, "-m", "kvrouter.cli", *args])


if __name__ == "__main__":
    main()
