"""``kvrouter serve``'s default worker count: the cores it may run on, capped by its cgroup's CPU quota
(the files as the kernel writes them, cgroup v2 and v1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvrouter.commands.serve import cpu_quota, default_workers

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "50000 100000\n"}, 0.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu.max": "garbage\n"}, None),
        ({}, None),
    ],
)
def test_quota_from_cgroup_files(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota


def test_default_is_the_cores_capped_by_the_quota(tmp_path: Path) -> None:
    assert default_workers(tmp_path) == CORES  # no limit
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert default_workers(tmp_path) == 1  # half a CPU: still one worker
    (tmp_path / "cpu.max").write_text(f"{(CORES + 8) * 100000} 100000\n")
    assert default_workers(tmp_path) == CORES  # a quota above the cores does not add workers
    if CORES >= 2:
        (tmp_path / "cpu.max").write_text("110000 100000\n")
        assert default_workers(tmp_path) == 2  # 1.1 CPUs: rounded up
