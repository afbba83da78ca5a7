"""The long-running commands run on jemalloc when it is installed: ``kvrouter serve`` started as a real
process re-executes itself once with jemalloc preloaded, keeps its pid, and says so in its metrics;
``KVROUTER_ALLOCATOR=system`` keeps glibc's, and a bad value is refused before anything starts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from kvrouter.allocator import REEXEC_MARK, AllocatorError, choice_of, find_jemalloc, reexec_env
from tests.support.net import free_port
from tests.support.wait import answering

LIB = "/opt/lib/libjemalloc.so.2"


def test_choice_is_validated() -> None:
    assert choice_of({}) == "auto"
    assert choice_of({"KVROUTER_ALLOCATOR": " JeMalloc "}) == "jemalloc"
    assert choice_of({"KVROUTER_ALLOCATOR": "system"}) == "system"
    with pytest.raises(AllocatorError, match="expected auto, jemalloc or system"):
        choice_of({"KVROUTER_ALLOCATOR": "tcmalloc"})


def test_reexec_only_when_it_changes_something() -> None:
    base = {"PATH": "/bin"}
    assert reexec_env(base, "system", "system", LIB) is None
    assert reexec_env(base, "auto", "jemalloc", LIB) is None  # already on it
    assert reexec_env(base, "auto", "system", None) is None  # not installed: carry on
    env = reexec_env(base, "auto", "system", LIB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": LIB, REEXEC_MARK: "1"}
    # an existing preload is kept, after jemalloc
    env = reexec_env({**base, "LD_PRELOAD": "/x/libfoo.so"}, "jemalloc", "system", LIB)
    assert env is not None and env["LD_PRELOAD"] == f"{LIB} /x/libfoo.so"
    # tried once and still not on it (the preload failed): never loop
    assert reexec_env({**base, REEXEC_MARK: "1"}, "auto", "system", LIB) is None


def test_jemalloc_demanded_but_unavailable_is_an_error() -> None:
    with pytest.raises(AllocatorError, match="not found"):
        reexec_env({}, "jemalloc", "system", None)
    with pytest.raises(AllocatorError, match="preloaded but is not in use"):
        reexec_env({REEXEC_MARK: "1"}, "jemalloc", "system", LIB)


@contextmanager
def served(tmp: Path, allocator: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    fleet = tmp / "fleet.yaml"
    fleet.write_text(
        yaml.safe_dump(
            {"block_size": 16, "instances": [{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}]}
        )
    )
    port = free_port()
    cmd = [sys.executable, "-m", "kvrouter.cli", "--log-level", "WARNING", "serve", "--fleet", str(fleet)]
    cmd += ["--port", str(port), "--workers", "1", "--no-events"]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXEC_MARK)}
    env["KVROUTER_ALLOCATOR"] = allocator
    log = tmp / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            asyncio.run(answering(base + "/livez"))
        except AssertionError as e:
            raise AssertionError(f"{e}; exit code {proc.poll()}; log: {log.read_text()}") from e
        yield proc, base
    finally:
        proc.terminate()
        proc.wait(10)


def maps_jemalloc(pid: int) -> bool:
    return "libjemalloc" in Path(f"/proc/{pid}/maps").read_text()


def allocator_metric(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("kvrouter_allocator{")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.skipif(find_jemalloc() is None, reason="jemalloc is not installed (libjemalloc2)")
def test_serve_runs_on_jemalloc_and_keeps_its_pid(tmp_path: Path) -> None:
    with served(tmp_path, "auto") as (proc, base):
        assert maps_jemalloc(proc.pid)  # the same pid: re-executed in place, not a child
        assert allocator_metric(base) == 'kvrouter_allocator{allocator="jemalloc"} 1.0'


def test_system_keeps_the_c_library_allocator(tmp_path: Path) -> None:
    with served(tmp_path, "system") as (proc, base):
        assert not maps_jemalloc(proc.pid)
        assert allocator_metric(base) == 'kvrouter_allocator{allocator="system"} 1.0'


def test_a_bad_choice_is_refused_before_start(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"instances": [{"name": "a", "url": "http://127.0.0.1:9"}]}))
    out = subprocess.run(
        [sys.executable, "-m", "kvrouter.cli", "serve", "--fleet", str(fleet)],
        env={**os.environ, "KVROUTER_ALLOCATOR": "tcmalloc"},
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert b"KVROUTER_ALLOCATOR='tcmalloc': expected auto, jemalloc or system" in out.stderr
