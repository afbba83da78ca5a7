"""Helpers shared by the benchmarks: percentiles, RSS, running a peer harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peerbench_dir() -> Path | None:
    """Where the peer harnesses live (``$PEERBENCH_DIR`` or ``../shared/peerbench``), if present."""
    env = os.environ.get("PEERBENCH_DIR")
    cands = [Path(env)] if env else []
    here = Path(__file__).resolve()
    cands += [p / "shared" / "peerbench" for p in here.parents]
    return next((c for c in cands if (c / "dynamo_radix_bench.py").exists()), None)


def peer_python(venv: str) -> Path | None:
    """A peer venv's python ($PEER_VENVS, default ~/.cache/peerbench, as ``setup.sh`` makes them); the
    harnesses read $PEER_VENVS themselves, so it is set for them here."""
    root = Path(os.environ.get("PEER_VENVS", Path.home() / ".cache" / "peerbench"))
    py = root / venv / "bin" / "python"
    if not py.exists():
        return None
    os.environ.setdefault("PEER_VENVS", str(root))
    return py


def run_peer(cmd: list[str], timeout: float = 900) -> dict[str, Any] | None:
    """Run a peer harness that prints one JSON line; None if it is unavailable or fails."""
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        print(f"peer benchmark unavailable: {e}", file=sys.stderr)
        return None
