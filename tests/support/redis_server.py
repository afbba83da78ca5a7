"""A real ``redis-server`` for the Redis-backed suites, started and killed by the tests themselves.

Other test modules import ``redis_server`` (the fixture) and ``RedisServer`` from here.  The server binds
127.0.0.1 on a free port below 32768, persists nothing, and is killed at teardown.  A machine without
``redis-server`` fails these suites instead of skipping them (``.ci/run`` installs the Debian package);
set ``KVROUTER_SKIP_REDIS=1`` to skip them knowingly on a workstation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import redis

from ..conftest import free_port


class RedisServer:
    """One ``redis-server`` process: ``start()``, ``stop()`` (a crash, as far as clients can tell)."""

    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("KVROUTER_SKIP_REDIS") == "1":
                pytest.skip("redis-server not installed (KVROUTER_SKIP_REDIS=1)")
            pytest.fail(
                "redis-server is not installed: apt-get install redis-server (or KVROUTER_SKIP_REDIS=1)"
            )
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvrouter-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        cmd += ["--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"redis-server exited: {err}")
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING within 10 s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=False)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
