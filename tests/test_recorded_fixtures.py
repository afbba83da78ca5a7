"""Fixtures recorded from vLLM name what they were recorded with, and the suite holds that to what it claims.

Which recordings can drift, and what holds them:

* ``wire`` (each release's own classes, from its wheel): pinned to releases that never change; cannot
  drift (``make golden-wire-check`` re-derives them).
* ``vllm_scheduler``, ``vllm_offload`` (vLLM's scheduler and connector, pure Python): a function of the
  vLLM release alone (and of ``PYTHONHASHSEED``, which the offload recorder fixes); they drift only if
  re-recorded with another release: each must name the claimed one.
* ``parity``, ``agent_inputs`` (vLLM's render server): vLLM renders with the transformers, tokenizers and
  jinja2 of its own environment, ``tokenizer_cache`` with ours, and neither is pinned to the other's.
  The parity fixtures record vLLM's versions; a parity failure names every library installed here at
  another version (``recorded.drift_note``), so a library's change is told from ours.  Versions alone do
  not fail: only a rendering that differs does.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.parity_check import recorded_models
from tests.support.recorded import (
    RENDER_LIBRARIES,
    VLLM_CLAIMED,
    VLLM_OFFLOAD,
    VLLM_SCHEDULER,
    drift_note,
    library_drift,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def recordings() -> list[tuple[Path, str]]:
    """(fixture file, the make target that re-records it) for every recording from vLLM's own code."""
    out = [(FIXTURES / "vllm_scheduler" / f"{n}.json", "golden-scheduler") for n in VLLM_SCHEDULER]
    out += [(FIXTURES / "vllm_offload" / f"{n}.json", "golden-offload") for n in VLLM_OFFLOAD]
    out += [(FIXTURES / "parity" / f"{n}.json", "parity-fixtures") for n in recorded_models()]
    out += [(p, "tools/agent_fixtures.py") for p in sorted((FIXTURES / "agent_inputs").glob("*.json"))]
    return out


def recorded_vllm(doc: dict[str, Any]) -> str:
    version = doc.get("vllm") or doc.get("versions", {}).get("vllm")
    assert isinstance(version, str), "the recording does not name its vLLM release"
    return version


def test_every_recording_is_of_the_claimed_vllm() -> None:
    files = recordings()
    assert {target for _, target in files} == {
        "golden-scheduler",
        "golden-offload",
        "parity-fixtures",
        "tools/agent_fixtures.py",
    }
    for path, target in files:
        version = recorded_vllm(json.loads(path.read_text(encoding="utf-8")))
        assert version == VLLM_CLAIMED, (
            f"{path.relative_to(FIXTURES)}: recorded with vLLM {version}, the project claims "
            f"{VLLM_CLAIMED}: re-record it ({target}) with vllm=={VLLM_CLAIMED}, or change the claim"
        )


@pytest.mark.parametrize("name", recorded_models())
def test_parity_recordings_name_the_rendering_libraries(name: str) -> None:
    versions = json.loads((FIXTURES / "parity" / f"{name}.json").read_text(encoding="utf-8"))["versions"]
    assert "transformers" in versions  # tokenizers and jinja2 too, from recordings made after they were added
    assert set(versions) <= {"vllm", *RENDER_LIBRARIES}


def test_the_drift_note_names_a_library_that_differs() -> None:
    here = importlib.metadata.version("transformers")
    assert library_drift({"transformers": here, "vllm": "0.0.1"}) == []  # vLLM is not ours to compare
    assert "ours" in drift_note({"transformers": here})
    assert library_drift({"transformers": "0.0.1"}) == [
        f"transformers {here} here, 0.0.1 in vLLM's recording"
    ]
    note = drift_note({"transformers": "0.0.1", "jinja2": "0.0.2"})
    assert "transformers" in note and "jinja2" in note and "make parity-fixtures" in note
