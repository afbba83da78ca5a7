"""Where the simulated fleet and the tests look for free ports: the whole range below Linux's ephemeral
ports, or the slice a parallel test worker was given (``KVROUTER_PORT_RANGE``), ignored when malformed."""

from __future__ import annotations

import pytest

from kvrouter.lab.sim.server.fleet import PORT_RANGE_ENV, free_port_block, port_range


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, (20000, 32000)),
        ("23000-26000", (23000, 26000)),
        ("26000-23000", (20000, 32000)),  # reversed
        ("19000-21000", (20000, 32000)),  # outside the range
        ("23000-23100", (20000, 32000)),  # too narrow to find a block in
        ("soon", (20000, 32000)),
    ],
)
def test_port_range_reads_a_worker_s_slice(
    monkeypatch: pytest.MonkeyPatch, value: str | None, want: tuple
) -> None:
    if value is None:
        monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    else:
        monkeypatch.setenv(PORT_RANGE_ENV, value)
    assert port_range() == want


def test_a_free_block_lies_in_the_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "24000-24400")
    for _ in range(20):
        base = free_port_block(8)
        assert base >= 24000 and base + 8 <= 24400
