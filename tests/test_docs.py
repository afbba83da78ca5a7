"""Reference documents generated from the code are what the code says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_reference_is_up_to_date() -> None:
    out = subprocess.run(
        [sys.executable, "tools/config_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
