"""``kvrouter reliability`` itself, and the static scan of logging calls the log-hygiene scenario runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrouter.cli import main as cli_main
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, render_table
from kvrouter.lab.reliability.security import scan_log_calls


def test_the_static_log_scan_finds_content_in_logging_calls(tmp_path: Path) -> None:
    root = tmp_path
    (root / "indexer").mkdir()
    (root / "indexer" / "bad.py").write_text(
        "import logging\nlog = logging.getLogger()\n"
        "def f(payload, ev):\n"
        "    log.debug('got %s', payload)\n"
        "    log.info('x', extra={'n': len(payload)})\n"
        "    log.warning('y', extra={'t': ev.token_ids})\n"
    )
    for pkg in ("kvrouter/gateway", "kvrouter/replicas", "kvrouter/membership"):
        (root / pkg).mkdir(parents=True)
    assert scan_log_calls(root) == ["indexer/bad.py:4 payload", "indexer/bad.py:6 token_ids"]


def test_the_command_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rel.json"
    md = tmp_path / "rel.md"
    rc = cli_main(
        ["reliability", "--quick", "--only", "event-fuzz", "--json", str(out), "--markdown", str(md)]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert (
        "| Bad input | Event decoder + index fuzz" in printed
        and "exceptions escaping apply_payload" in printed
    )
    data = json.loads(out.read_text())
    assert data["quick"] and data["results"][0]["name"] == "event-fuzz"
    assert "| Area" in md.read_text()


def test_the_table_marks_failures_and_errors() -> None:
    ok = ScenarioResult("a", "Faults", "A", [Figure("x", "1", "1", True)], 1.0)
    bad = ScenarioResult("b", "Load", "B", [Figure("y", "2", "0", False)], 2.0)
    broken = ScenarioResult("c", "Security", "C", [], 0.5, error="ScenarioError: boom")
    table = render_table([ok, bad, broken])
    assert ok.ok and not bad.ok and not broken.ok
    assert "| pass |" in table and "| FAIL |" in table and "boom" in table
    assert table.splitlines()[1].startswith("|--")


def test_unknown_scenarios_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["reliability", "--only", "nope"]) == 2
    assert "unknown scenarios: nope" in capsys.readouterr().err
