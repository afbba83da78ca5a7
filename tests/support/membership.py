"""A membership seam that records every call, for the reconciler and discovery tests."""

from __future__ import annotations

import asyncio

from indexer.config import InstanceConfig


class FakeMembership:
    """Records every call; ``in_flight`` is set by the test, ``fail_add`` makes adds raise."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.flights: dict[str, int] = {}
        self.fail_add = 0

    async def add(self, i: InstanceConfig) -> None:
        await asyncio.sleep(0)
        if self.fail_add:
            self.fail_add -= 1
            raise OSError("boom")
        self.calls.append(("add", i.name))

    def update(self, i: InstanceConfig) -> None:
        self.calls.append(("update", i.name))

    def drain(self, name: str) -> None:
        self.calls.append(("drain", name))

    def undrain(self, name: str) -> None:
        self.calls.append(("undrain", name))

    def in_flight(self, name: str) -> int:
        return self.flights.get(name, 0)

    async def remove(self, name: str) -> None:
        await asyncio.sleep(0)
        self.calls.append(("remove", name))
