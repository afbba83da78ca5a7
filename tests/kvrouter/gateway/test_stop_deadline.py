"""A stopping router always exits: ``lean.core.finish`` cancels the serving task and then every other,
and gives up on a task that does not end (one that swallows its cancellation) after its deadline, naming
it in the log, rather than waiting for it for good."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from kvrouter.gateway.lean.core import finish


async def _stubborn() -> None:
    """Swallows every cancellation (as a library that turns one into an error it retries on might)."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


async def _cleanup_then_end(log: list[str]) -> None:
    try:
        await asyncio.sleep(3600)
    finally:
        await asyncio.sleep(0.01)  # a cleanup that awaits, as the gateway's does
        log.append("cleaned up")


def test_a_stop_whose_tasks_end_runs_their_cleanup() -> None:
    loop = asyncio.new_event_loop()
    log: list[str] = []
    main = loop.create_task(_cleanup_then_end(log))
    other = loop.create_task(asyncio.sleep(3600))
    loop.run_until_complete(asyncio.sleep(0))
    assert finish(loop, main, 5.0, rest_s=5.0)
    assert log == ["cleaned up"] and other.cancelled()
    loop.close()


def test_a_task_that_swallows_its_cancellation_is_left_behind_after_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.new_event_loop()
    main = loop.create_task(_stubborn(), name="stubborn")
    loop.run_until_complete(asyncio.sleep(0))
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kvrouter.gateway.lean"):
        assert not finish(loop, main, 0.2, rest_s=0.2)
    assert time.monotonic() - t0 < 2.0
    recs = [r for r in caplog.records if "deadline" in r.getMessage()]
    assert recs  # after main's deadline, and again after the rest's
    for rec in recs:
        where = rec.__dict__["tasks"]
        assert list(where) == ["stubborn"] and any("_stubborn" in f for f in where["stubborn"])
    loop.close()
    main.get_coro().close()  # left behind by design; closed here so the test leaves nothing pending


async def _fails_in_cleanup() -> None:
    try:
        await asyncio.sleep(3600)
    finally:
        raise RuntimeError("cleanup broke")


def test_an_error_in_a_stop_is_logged_not_lost(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    main = loop.create_task(_fails_in_cleanup(), name="main")
    loop.run_until_complete(asyncio.sleep(0))
    with caplog.at_level(logging.ERROR, logger="kvrouter.gateway.lean"):
        assert finish(loop, main, 1.0, rest_s=1.0)
    [rec] = [r for r in caplog.records if "failed while stopping" in r.getMessage()]
    assert rec.exc_info is not None and "cleanup broke" in str(rec.exc_info[1])
    loop.close()
