"""``kvrouter serve --workers N``: N gateway processes on one port, loaded once, routing as one.

::

    supervisor: fleet file ─▶ tokenizers loaded, hashing compiled ─▶ shared memory + lock ─▶ heap frozen
        │  fork × N (each inherits the loaded tokenizers copy-on-write: shared, not loaded N times)
        ├── worker 0 (leader)  own event loop, own listening socket (SO_REUSEPORT), own index (subscribed)
        ├── worker 1 ...       the kernel spreads connections over the sockets
        └── wait: a worker that dies is replaced (its rows cleared: its requests died with it); SIGTERM /
                  SIGINT go to every worker, which drain as one process would

Every worker subscribes to the KV events itself (docs/gateway.md, "Every core": a shared index would put an
IPC round trip or a lock on every request to save the index's memory, small next to the tokenizers').
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from ..config import RouterFleetConfig
from ..pipeline import FleetTokens
from . import HostLayout, HostMemory, MetricsBoard
from .memory import FLOW_SLOTS
from .scrape import wake_pipes
from .wiring import WorkerHost

log = logging.getLogger("kvrouter.host")

RESPAWN_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)
"""Delay before replacing a worker, by how many times that worker died within the last minute."""


def shared_host(cfg: RouterFleetConfig, workers: int) -> HostMemory:
    """The host's shared memory (an anonymous shared mapping every forked worker inherits) with the
    fleet's instances healthy, as a single process starts them (optimistic until the first check)."""
    targets = max(256, 4 * sum(i.dp_size for i in cfg.instances))
    # Beside the flows' accounts, which are forgotten when the table is full, the names that keep their
    # slots: each configured tenant's rate buckets and counts, each priority level's virtual time, and
    # the queue's groups (model, instance pinned or not, heavy or not).
    kept = 2 * len(cfg.flows.tenants) + len(cfg.flows.levels())
    kept += 2 * len(cfg.served_models()) * (len(cfg.instances) + 1)
    layout = HostLayout(
        workers=workers,
        targets=targets,
        instances=max(128, 4 * len(cfg.instances)),
        flows=FLOW_SLOTS + kept,
        metric_bytes=max(1 << 20, 8192 * targets),  # per-target series dominate a snapshot
    )
    buf = mmap.mmap(-1, layout.size(), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    mem = HostMemory(layout, memoryview(buf), multiprocessing.get_context("fork").Lock())
    health = mem.view("health")
    for inst in cfg.instances:
        if inst.url:
            health[mem.instances.slot(inst.name)] = (1.0, 1.0, 0, 0, 0.0, float("-inf"))
    return mem


def preload(cfg: RouterFleetConfig, tokens: FleetTokens) -> None:
    """What every worker would otherwise load or compile for itself: loaded once, before the fork (and
    before a single process listens).  Every indexer kernel, not only the hashing ones: numba compiles a
    kernel on its first call, so workers left to compile the ingest kernels on their first events did it
    all at once, each for itself, and on a busy 2-core machine their first requests waited up to a minute
    (issue 29's bench, with 18 router processes).  With numba's on-disk cache warm this takes about 0.5 s.
    Each tokenizer is warmed too (``CachedTokenizer.warm``: its vocabulary's longest entry and its chat
    template, 0.2 s or so per worker and model otherwise, on the first requests)."""
    from indexer.kernels import compile_all
    from tokenizer_cache import TokenizerCacheError

    compile_all()
    if tokens.registry is not None:
        for m in cfg.served_models():
            try:
                tokens.registry.get(m).warm()
            except TokenizerCacheError:
                continue


PR_SET_PDEATHSIG = 1
"""``prctl``'s option: the signal a process is sent when its parent dies (``linux/prctl.h``)."""


def die_with(parent: int) -> None:
    """This worker is sent SIGTERM when ``parent`` (the supervisor) dies, however it dies (SIGKILL, the
    OOM killer), rather than serving on as an orphan that nobody replaces or stops (Linux:
    ``PR_SET_PDEATHSIG``; elsewhere nothing changes)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Forks the workers, replaces those that die, stops them all on a signal."""

    def __init__(self, workers: int, run_worker: Callable[[WorkerHost], int], mem: HostMemory) -> None:
        self.n = workers
        self.run_worker = run_worker
        self.mem = mem
        self.children: dict[int, int] = {}
        self.deaths: dict[int, list[float]] = {k: [] for k in range(workers)}
        self.stopping = False
        self.pipes = wake_pipes(workers)

    def _spawn(self, k: int) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                die_with(parent)
                code = self.run_worker(WorkerHost(self.mem, k, self.pipes))
            except BaseException:
                log.exception("worker failed", extra={"worker": k})
            finally:
                logging.shutdown()
                os._exit(code)
        self.children[pid] = k
        log.info("worker started", extra={"worker": k, "pid": pid})

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = True
        for pid in list(self.children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        gc.collect()
        gc.freeze()  # the loaded heap is shared with the workers: no collection should write to it
        for k in range(self.n):
            self._spawn(k)
        failed = 0
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid not in self.children:
                continue
            k = self.children.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if self.stopping:
                continue
            failed += 1
            log.error("worker died; replacing it", extra={"worker": k, "pid": pid, "exit": code})
            self._replace(k)
        return 1 if failed and not self.stopping else 0

    def _replace(self, k: int) -> None:
        # Its requests died with it: its load and queue rows count nothing any more.
        self.mem.view("loads")[k] = 0
        self.mem.view("queue")[k] = 0
        self.mem.view("flow_waiting")[k] = 0
        MetricsBoard(self.mem, k).clear_row(k)  # its last snapshot stays: its replacement starts from it
        now = time.monotonic()
        recent = [t for t in self.deaths[k] if now - t < 60.0]
        self.deaths[k] = [*recent, now]
        time.sleep(RESPAWN_BACKOFF_S[min(len(recent), len(RESPAWN_BACKOFF_S) - 1)])
        if not self.stopping:
            self._spawn(k)
