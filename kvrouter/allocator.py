"""Which C allocator the long-running commands run on: jemalloc when it is installed, else the system's.

Why: under steady load the gateway's resident memory grew while its Python heap did not.  glibc's malloc
keeps freed chunks inside its arenas and returns pages only from an arena's top, so the pages a peak of
requests touched stay resident, and each new peak fragments them further (docs/reliability.md, "Runs of
2026-12-03"; `tools/heap_growth.py`).  Under jemalloc, which returns dirty pages to the kernel after a
decay time, the same run stayed flat.  An allocator cannot be swapped inside a running process, so the
command re-executes itself once with jemalloc in ``LD_PRELOAD``, before it has loaded anything.

``KVROUTER_ALLOCATOR`` chooses: ``auto`` (the default: jemalloc when found, else the system's),
``jemalloc`` (fail when it is not found) or ``system`` (never re-execute).

Invariants: a process re-executes at most once (``REEXEC_MARK`` in its environment says it has tried);
only the process's own command line is re-executed (``cli.main`` with ``argv=None``), never a caller
that runs a command in-process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal


class AllocatorError(ValueError):
    """``KVROUTER_ALLOCATOR`` names no allocator, or demands jemalloc where it cannot be had.  (Not the
    indexer's ``ConfigError``: importing the indexer before the re-execution would double its cost.)"""


Choice = Literal["auto", "jemalloc", "system"]
ENV = "KVROUTER_ALLOCATOR"
REEXEC_MARK = "KVROUTER_ALLOCATOR_REEXEC"
LONG_RUNNING = frozenset({"serve", "epp", "indexer"})
"""The commands that serve until stopped: the ones whose memory must not creep."""

_KNOWN_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


def choice_of(env: Mapping[str, str]) -> Choice:
    """``KVROUTER_ALLOCATOR`` validated; ``auto`` when unset or empty."""
    raw = env.get(ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "jemalloc", "system"):
        raise AllocatorError(f"{ENV}={raw!r}: expected auto, jemalloc or system")
    return raw  # type: ignore[return-value]


def find_jemalloc() -> str | None:
    """The path of jemalloc's shared library, or None when it is not installed."""
    for p in _KNOWN_PATHS:
        if Path(p).is_file():
            return p
    return ctypes.util.find_library("jemalloc")  # a soname (ld.so resolves it), found via ldconfig


def active() -> str:
    """The allocator this process's ``malloc`` is: "jemalloc" when jemalloc's own entry point
    (``mallctl``) is in the global symbol table, else "system"."""
    try:
        ctypes.CDLL(None).mallctl  # noqa: B018 - the lookup is the test
    except (AttributeError, OSError):
        return "system"
    return "jemalloc"


def reexec_env(
    env: Mapping[str, str], choice: Choice, current: str, lib: str | None
) -> dict[str, str] | None:
    """The environment to re-execute this process with, or None to carry on as it is.  Pure.

    Raises ``AllocatorError`` when jemalloc was demanded and cannot be had."""
    if choice == "system" or current == "jemalloc":
        return None
    if lib is None or env.get(REEXEC_MARK):
        if choice == "jemalloc":
            why = "not found" if lib is None else f"{lib} was preloaded but is not in use"
            raise AllocatorError(f"{ENV}=jemalloc: jemalloc {why} (install libjemalloc2)")
        return None
    preload = env.get("LD_PRELOAD", "").strip()
    out = dict(env)
    out["LD_PRELOAD"] = f"{lib} {preload}" if preload else lib
    out[REEXEC_MARK] = "1"
    return out


def prefer_jemalloc(command: str | None) -> None:
    """Re-execute this process under jemalloc if ``command`` is long-running and the choice allows it.
    Returns only when the process carries on as it is.  Raises ``AllocatorError`` (see ``reexec_env``)."""
    if command not in LONG_RUNNING:
        return
    choice = choice_of(os.environ)
    env = reexec_env(os.environ, choice, active(), find_jemalloc())
    if env is None:
        return
    if not sys.executable:  # an embedded interpreter: nothing to re-execute
        if choice == "jemalloc":
            raise AllocatorError(f"{ENV}=jemalloc: this interpreter cannot re-execute itself")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as e:  # returns only on failure: carry on with the allocator in use
        if choice == "jemalloc":
            raise AllocatorError(f"{ENV}=jemalloc: re-executing failed: {e}") from e
