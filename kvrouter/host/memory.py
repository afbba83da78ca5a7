"""One block of memory shared by the worker processes of one host, cut into named numpy views.

::

    HostLayout(workers, targets, instances, ring_words) ─ HostMemory(buffer).view(name):
      loads int64 [workers, targets, 4] (each worker its row)   engine float64 [targets, 4]
      external int64 [targets, 2]   health float64 [instances, 6]   queue int64 [workers, 5]
      flow_* (host/flows)   rings int64 [workers, ring_words]   metric_* (metrics_board)
      claims int64 [claim_slots, 3] (host/claims)   peer_queue float64 [1 + peer_heads, 4] (host/queue)
      latency float64 [targets, LATENCY_WORDS] (host/latency)
      SlotDirectory: names -> slots (targets; instances; flows)

The buffer comes from the caller (an anonymous shared mapping made before the workers fork, or a plain
``bytearray`` in one process and in tests): nothing here opens a file or a socket.  Every field is an
aligned 8-byte word, so a reader never sees half of another process's write; a row written by one
process only (its own load, its own ring) needs no lock.  Shared cells that several workers write (slot
allocation, health) change under the ``lock`` the caller passes (a process-shared lock after a fork).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Protocol

import msgspec
import numpy as np

NAME_BYTES = 120
"""Longest name a slot holds (UTF-8); longer target keys are refused (``SlotsExhausted``)."""
LATENCY_WORDS = 96
"""Room for one target's latency models (``host/latency``; they take ``SHARED_WORDS``)."""


FLOW_SLOTS = 1024
"""The flows' table's slots by default (``HostLayout.flows``; ``serve`` adds the names that keep theirs)."""

QUEUE_GROUPS = 4
"""Groups a worker's waiting heads are of, shown to the other workers (``host.queue``): a newcomer of
another group need not wait behind them (``pipeline.gate``).  More than this: unknown, every newcomer
waits."""
QUEUE_COLUMNS = 5 + QUEUE_GROUPS


class HostLock(Protocol):
    """A lock every worker of the host shares (``multiprocessing.Lock`` made before the fork)."""

    def __enter__(self) -> object: ...

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None, /
    ) -> object: ...


class SlotsExhausted(Exception):
    """More distinct names than the layout has slots for (or a name too long for one)."""


class HostLayout(msgspec.Struct, frozen=True):
    workers: int
    """Worker processes sharing the memory (each owns one row of loads, queue and rings)."""
    targets: int = 256
    """Distinct (instance, rank) keys the host can account for."""
    instances: int = 128
    """Distinct instances whose health is shared."""
    ring_words: int = 1 << 18
    """Size of each worker's ring of speculative entries, in 8-byte words (2 MiB by default)."""
    metric_bytes: int = 1 << 20
    """Room for each worker's last metrics snapshot (``metrics_board``), in bytes."""
    claim_slots: int = 4096
    """Placement claims of new prompts the workers can hold at once (``host.claims``)."""
    flows: int = FLOW_SLOTS
    """Distinct flow accounts (a tenant at a priority, a priority's virtual time, a tenant's rate
    buckets) the host keeps.  Past them, the least recently charged flows without waiters are forgotten
    (``host.flows``); when none can be, new ones share one overflow account."""
    peer_heads: int = 64
    """Other router replicas' best waiters the host keeps (``host.queue``); past them, the rest are not
    ranked against."""

    def fields(self) -> list[tuple[str, str, tuple[int, ...]]]:
        w, t, i = self.workers, self.targets, self.instances
        return [
            ("target_names", "u1", (t, NAME_BYTES + 8)),
            ("instance_names", "u1", (i, NAME_BYTES + 8)),
            ("counters", "i8", (4,)),
            ("loads", "i8", (w, t, 4)),
            ("engine", "f8", (t, 4)),
            ("external", "i8", (t, 2)),
            ("health", "f8", (i, 6)),
            ("queue", "i8", (w, QUEUE_COLUMNS)),
            ("ring_heads", "i8", (w, 8)),
            ("rings", "i8", (w, self.ring_words)),
            ("metric_heads", "i8", (w, 8)),
            ("flow_names", "u1", (self.flows, NAME_BYTES + 8)),
            ("flow_epoch", "i8", (3,)),
            ("flow_accounts", "f8", (self.flows, 4)),
            ("flow_waiting", "i8", (w, self.flows)),
            ("peer_queue", "f8", (1 + self.peer_heads, 4)),
            ("latency", "f8", (t, LATENCY_WORDS)),
            ("claims", "i8", (self.claim_slots, 3)),
            ("metric_bytes", "u1", (w, self.metric_bytes)),
        ]

    def size(self) -> int:
        return sum(_nbytes(dt, shape) for _, dt, shape in self.fields())


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = int(np.dtype(dtype).itemsize * int(np.prod(shape)))
    return (n + 63) // 64 * 64  # each view starts on its own cache line


class HostMemory:
    """Typed views over the shared buffer (every process builds the same views over the same bytes)."""

    def __init__(self, layout: HostLayout, buffer: memoryview | bytearray, lock: HostLock) -> None:
        if len(buffer) < layout.size():
            raise ValueError(f"buffer of {len(buffer)} bytes; the layout needs {layout.size()}")
        self.layout = layout
        self.lock = lock
        self._views: dict[str, np.ndarray] = {}
        off = 0
        for name, dt, shape in layout.fields():
            n = int(np.prod(shape))
            self._views[name] = np.frombuffer(buffer, dtype=dt, count=n, offset=off).reshape(shape)
            off += _nbytes(dt, shape)
        self.targets = SlotDirectory(self._views["target_names"], lock)
        self.instances = SlotDirectory(self._views["instance_names"], lock)
        self.flows = SlotDirectory(self._views["flow_names"], lock, epoch=self._views["flow_epoch"][:1])

    def view(self, name: str) -> np.ndarray:
        return self._views[name]


class SlotDirectory:
    """Names to slots, the same in every process: a slot, once given to a name, keeps it for the host's
    life (a removed instance's slot is reused only by the same name), so rows never change meaning;
    except in a directory with an ``epoch`` cell, where a full table may free slots (``slot``'s
    ``reclaim``): the epoch then moves, and every process drops its cache at its next lookup.

    Each entry is ``[used: u1 x 8][utf-8 name, zero-padded]``; lookups are served from a per-process
    cache, and a name missing from it is looked for (and, if new, allocated) under the lock."""

    def __init__(self, table: np.ndarray, lock: HostLock, *, epoch: np.ndarray | None = None) -> None:
        self._t = table
        self._lock = lock
        self._cache: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._epoch = epoch
        self._seen = 0
        """The epoch this process's cache is of."""

    def epoch(self) -> int:
        """How many times slots were freed (0 in a directory that never frees)."""
        return 0 if self._epoch is None else int(self._epoch[0])

    def _fresh(self) -> None:
        if self._epoch is not None and int(self._epoch[0]) != self._seen:
            self._seen = int(self._epoch[0])
            self._cache.clear()
            self._names.clear()

    def __len__(self) -> int:
        return int(np.count_nonzero(self._t[:, 0]))

    def slot(self, name: str, reclaim: Callable[[], list[int]] | None = None) -> int:
        """The slot of ``name``, allocated if new.  ``reclaim`` (a directory with an epoch): called under
        the lock when the table is full, it names slots to free (their rows' other data cleared by it)."""
        self._fresh()
        s = self._cache.get(name)
        if s is not None:
            return s
        raw = name.encode()
        if len(raw) > NAME_BYTES:
            raise SlotsExhausted(f"name longer than {NAME_BYTES} bytes: {name[:40]!r}...")
        with self._lock:
            self._fresh()
            self._scan()
            s = self._cache.get(name)
            if s is None:
                free = np.flatnonzero(self._t[:, 0] == 0)
                if not len(free) and reclaim is not None and self._epoch is not None:
                    freed = reclaim()
                    if freed:
                        self._t[freed] = 0
                        self._epoch[0] += 1
                        self._fresh()
                        self._scan()
                        free = np.flatnonzero(self._t[:, 0] == 0)
                if not len(free):
                    raise SlotsExhausted(f"all {len(self._t)} slots are taken")
                s = int(free[0])
                row = self._t[s]
                row[8 : 8 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
                row[0] = 1  # written last: a reader that sees the flag sees the name
                self._cache[name], self._names[s] = s, name
        return s

    def find(self, name: str) -> int | None:
        """The name's slot if some process gave it one (never allocates)."""
        self._fresh()
        if name not in self._cache:
            self._scan()
        return self._cache.get(name)

    def name(self, slot: int) -> str | None:
        self._fresh()
        if slot not in self._names:
            self._scan()
        return self._names.get(slot)

    def items(self) -> Iterator[tuple[str, int]]:
        """Every allocated (name, slot), including names other processes allocated."""
        self._fresh()
        self._scan()
        return iter(list(self._cache.items()))

    def _scan(self) -> None:
        used = np.flatnonzero(self._t[:, 0])
        if len(used) == len(self._names):
            return
        for slot in used.tolist():
            if slot not in self._names:
                name = bytes(self._t[slot, 8:]).rstrip(b"\x00").decode()
                self._cache[name], self._names[slot] = slot, name
