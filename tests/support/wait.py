"""Waiting on a condition in async tests: poll until it holds, with a generous deadline.

A test waits for what it is about (a batch applied, an instance ejected), never for a fixed time: on a busy
machine a fixed sleep is either too short (a flake) or too long everywhere.  The deadline only bounds a
hang, so it is generous (a minute by default): it costs nothing when the condition holds, and speed is for
the benchmarks to show, not for a test's timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp


async def until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Return as soon as ``cond()`` holds; fail after ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in {timeout} s")
        await asyncio.sleep(0.01)


async def answering(url: str, timeout: float = 60.0) -> None:
    """Return once ``url`` answers 200 (a server that restarts: refused, then up); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer 200 in {timeout} s")
            await asyncio.sleep(0.05)


async def until_async(
    cond: Callable[[], Awaitable[bool]], timeout: float = 60.0, what: str = "condition"
) -> None:
    """``until`` for a condition that must await (an HTTP request), polled every 50 ms."""
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in {timeout} s")
        await asyncio.sleep(0.05)
