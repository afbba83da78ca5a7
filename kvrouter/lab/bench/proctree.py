"""What a process tree costs while a peer harness drives it: CPU seconds and memory of every process in it.

A router of several worker processes is one process to a harness that reads ``/proc/PID/stat`` of the
process it started: its workers' CPU is not there.  ``TreeSampler`` finds the router by its command line
among the harness's descendants and samples the whole tree (every ``interval_s``): CPU (user + system, the
last sample of each process: workers live as long as the run), and memory as RSS and as PSS (each shared
page divided among the processes sharing it: the host's real cost of N forked workers).
"""

from __future__ import annotations

import os
import threading
from typing import Any

CLK = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / CLK
    except (OSError, IndexError, ValueError):
        return None


def memory_kb(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, private) in kB."""
    rss = pss = private = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                    private += int(line.split()[1])
    except OSError:
        pass
    return rss, pss, private


class TreeSampler:
    """Samples the tree rooted at the first descendant of ``parent`` whose command line holds ``marker``.

    CPU counts from the first sample at which ``ready_url`` answers and the tree has ``processes``
    processes (start-up, loading tokenizers, is not a request's cost)."""

    def __init__(
        self, parent: int, marker: str, *, ready_url: str, processes: int = 1, interval_s: float = 0.25
    ) -> None:
        self.parent = parent
        self.marker = marker
        self.ready_url = ready_url
        self.processes = processes
        self.interval_s = interval_s
        self.ready = False
        self.cpu: dict[int, float] = {}
        self.first_cpu: dict[int, float] = {}
        self.mem: list[tuple[int, int, int, int]] = []
        """(processes, RSS kB, PSS kB, tree kB) per sample: tree = the root's RSS + every other process's
        private pages (what the tree holds, each page once, when its workers share the root's pages)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        pss = [m[2] for m in self.mem]
        rss = [m[1] for m in self.mem]
        full = max((m[0] for m in self.mem), default=0)
        # While every process of the tree is up (a worker being replaced or the tree stopping is not it).
        pss_full = sorted(m[2] for m in self.mem if m[0] == full)
        return {
            "pss_mb_median": round(pss_full[len(pss_full) // 2] / 1024, 1) if pss_full else None,
            "processes": max((m[0] for m in self.mem), default=0),
            "cpu_s": round(sum(self.cpu.values()) - sum(self.first_cpu.values()), 3),
            "pss_mb_start": round(pss[0] / 1024, 1) if pss else None,
            "pss_mb_end": round(pss[-1] / 1024, 1) if pss else None,
            "pss_mb_max": round(max(pss) / 1024, 1) if pss else None,
            "rss_sum_mb_end": round(rss[-1] / 1024, 1) if rss else None,
            "tree_mb_end": round(self.mem[-1][3] / 1024, 1) if self.mem else None,
            "tree_mb_max": round(max(m[3] for m in self.mem) / 1024, 1) if self.mem else None,
        }

    def _root(self) -> int | None:
        for p in descendants(self.parent)[1:]:
            if self.marker in cmdline(p):
                return p
        return None

    def _is_ready(self, procs: list[int]) -> bool:
        import urllib.error
        import urllib.request

        if len(procs) < self.processes:
            return False
        try:
            with urllib.request.urlopen(self.ready_url, timeout=1) as r:
                return bool(r.status < 500)
        except (urllib.error.URLError, OSError):
            return False

    def _run(self) -> None:
        root = None
        while not self._stop.wait(self.interval_s):
            root = root or self._root()
            if root is None:
                continue
            procs = descendants(root)
            if not self.ready:
                self.ready = self._is_ready(procs)
                if not self.ready:
                    continue
            rss = pss = tree = 0
            for p in procs:
                c = cpu_s(p)
                if c is None:
                    continue
                self.first_cpu.setdefault(p, c)
                self.cpu[p] = c
                r, s, private = memory_kb(p)
                rss, pss = rss + r, pss + s
                tree += r if p == root else private
            if rss:
                self.mem.append((len(procs), rss, pss, tree))
