"""Fetching single source files of released vLLM wheels, for the golden-fixture recorders (dev tool).

A vLLM wheel is 300-400 MB and the recorders need one or two small Python files of it, so each wheel is
downloaded with pip (``pip download --no-deps``, the ordinary client), the wanted members are copied into
a cache outside the repository, and the wheel is deleted at once.  Later runs read the cache only.

Cache layout: ``$KVROUTER_VLLM_CACHE`` (default ``~/.cache/kvrouter/vllm-releases``)
``/<release>/<path inside the wheel>``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

KV_EVENTS = "vllm/distributed/kv_events.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
BLOCK_POOL = "vllm/v1/core/block_pool.py"
KV_CACHE_MANAGER = "vllm/v1/core/kv_cache_manager.py"
MEMBERS = (KV_EVENTS, KV_CACHE_UTILS, BLOCK_POOL, KV_CACHE_MANAGER)
"""Every member the recorders read: fetched together, so each wheel is downloaded once."""

# Platforms vLLM's x86_64 wheels were tagged with over the releases (manylinux1 for 0.9-0.10, 2_31 for
# 0.12-0.20, 2_28 for the others seen); pip picks the release's wheel among them.
_PLATFORMS = (
    "manylinux1_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_35_x86_64",
)


def cache_root() -> Path:
    env = os.environ.get("KVROUTER_VLLM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvrouter" / "vllm-releases"


def release_file(release: str, member: str = KV_EVENTS) -> Path:
    """The path of ``member`` of vLLM ``release``'s wheel in the cache, fetching the wheel if needed."""
    target = cache_root() / release / member
    if not target.exists():
        _fetch(release, [m for m in MEMBERS if not (cache_root() / release / m).exists()] or [member])
    return target


def _fetch(release: str, members: list[str]) -> None:
    root = cache_root() / release
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
        cmd += ["--python-version", "3.12", "--dest", tmp, f"vllm=={release}"]
        for p in _PLATFORMS:
            cmd += ["--platform", p]
        print(
            f"fetching vllm=={release} (one wheel, kept only until {members} are extracted)", file=sys.stderr
        )
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            for m in members:
                if m not in names:
                    continue  # absent from this release: release_file() reports the missing path
                out = root / m
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(m))


def main() -> None:
    """``python tools/vllm_release_files.py 0.9.0 0.10.0 ...``: warm the cache, print the paths."""
    for release in sys.argv[1:]:
        for member in MEMBERS:
            print(release_file(release, member))


if __name__ == "__main__":
    main()
