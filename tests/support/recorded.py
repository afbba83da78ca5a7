"""Fixture sets recorded from vLLM, found by name: a set that disappears or moves fails the run.

Parametrizing over a glob of an empty or misplaced folder gives zero cases, which pytest reports as
skipped and a run still passes; ``scenarios`` raises at collection instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

VLLM_SCHEDULER = (
    *("evictions", "preemption", "salt_lora", "shared_prefix"),
    *(f"random_{i}" for i in range(1, 6)),
)
"""The scenarios ``tools/record_vllm_scheduler.py`` records (tests/fixtures/vllm_scheduler)."""


class MissingFixtures(RuntimeError):
    pass


def scenarios(folder: Path, expected: Iterable[str], suffix: str = ".json") -> list[str]:
    """The recorded scenarios in ``folder`` (file stems), which must be exactly ``expected``."""
    want = sorted(expected)
    found = sorted(p.stem for p in folder.glob(f"*{suffix}"))
    if found != want:
        raise MissingFixtures(
            f"{folder}: recorded fixtures {found} differ from the expected {want} "
            "(re-record them with the Makefile's golden targets, or update the list with the recording)"
        )
    return found
