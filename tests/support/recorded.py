"""Fixture sets recorded from vLLM, found by name: a set that disappears or moves fails the run.

Parametrizing over a glob of an empty or misplaced folder gives zero cases, which pytest reports as
skipped and a run still passes; ``scenarios`` raises at collection instead.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

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


VLLM_OFFLOAD = (
    *(f"cpu_{kind}_chunk{bpc}" for kind in ("placeholders", "self_describing") for bpc in (1, 2)),
    "cpu_placeholders_whole_prompts",
    "cpu_placeholders_eviction_order",
)
"""The scenarios ``tools/record_vllm_offload.py`` records (tests/fixtures/vllm_offload)."""


class BlockNamer:
    """Names blocks by what they hold, so that two engines whose hashes differ (vLLM's sha256, the
    simulator's own) can be compared event by event.

    A stored block is named by (its parent's name, its tokens, its extra keys): the structure vLLM hashes.
    Each side keeps its own hash -> name map (``seen``); the names are shared, so equal content gets one
    name on both sides.  A placeholder (no tokens) and a removal name blocks that side stored before."""

    def __init__(self) -> None:
        self.names: dict[tuple[Any, ...], int] = {}

    def canonical(self, payload: bytes, seen: dict[Any, int]) -> list[dict[str, Any]]:
        """The batch's events, each with its hashes replaced by block names (``blocks``, ``parent``)."""
        out = []
        for ev in msgspec.msgpack.decode(payload)[1]:
            ev = dict(ev)
            hashes = ev.pop("block_hashes")
            if ev["type"] == "BlockStored" and ev["token_ids"]:
                parent = ev.pop("parent_block_hash")
                prev = None if parent is None else seen[parent]
                ev["parent"] = prev
                bs = ev["block_size"]
                keys = ev.get("extra_keys") or [None] * len(hashes)
                names = []
                for i, h in enumerate(hashes):
                    key = (prev, tuple(ev["token_ids"][i * bs : (i + 1) * bs]), json.dumps(keys[i]))
                    prev = seen[h] = self.names.setdefault(key, len(self.names))
                    names.append(prev)
                ev["blocks"] = names
            else:
                ev["blocks"] = [seen[h] for h in hashes]
            out.append(ev)
        return out


VLLM_CLAIMED = "0.33.0"
"""The vLLM release the project claims: every fixture recorded from vLLM's own code names the release it
was recorded with, and must name this one (tests/test_recorded_fixtures.py)."""

RENDER_LIBRARIES = ("transformers", "tokenizers", "jinja2")
"""What decides how a prompt renders and tokenizes, on vLLM's side (its render server) and on ours
(``tokenizer_cache``): the parity fixtures record the versions vLLM ran with."""


def library_drift(recorded: dict[str, str]) -> list[str]:
    """The rendering libraries the recording names whose installed version here differs from it."""
    out = []
    for lib in RENDER_LIBRARIES:
        if lib not in recorded:
            continue
        try:
            here = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            here = "not installed"
        if here != recorded[lib]:
            out.append(f"{lib} {here} here, {recorded[lib]} in vLLM's recording")
    return out


def drift_note(recorded: dict[str, str]) -> str:
    """For a parity failure: which rendering libraries differ from the recording's, if any (then the
    difference may be the library's, not ours: re-record, or install the recorded versions)."""
    drift = library_drift(recorded)
    if not drift:
        return "rendering libraries as in the recording: the difference is ours"
    return (
        "rendering libraries differ from the recording (" + "; ".join(drift) + "): the difference may be "
        "theirs; install the recorded versions to tell, or re-record (make parity-fixtures)"
    )
