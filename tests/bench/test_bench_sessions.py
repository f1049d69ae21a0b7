"""bench/sessions.py runs (2 sessions x 3 turns on the tiny model) and prints its fixed format."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_bench


def test_sessions_benchmark_smoke(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("sessions", monkeypatch)
    assert bench.main(["--model", str(tiny_folder), "--smoke"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [line[:2] for line in lines] == [
        ["sessions", "turn=1"],
        ["sessions", "turn=2"],
        ["sessions", "turn=3"],
        ["sessions", "summary"],
    ]
    fields = [dict(f.split("=", 1) for f in line[1:] if "=" in f) for line in lines]
    turns, summary = fields[:3], fields[3]
    assert [int(t["history_tokens"]) for t in turns] == [0, 10, 20]
    cached = [int(t["session_cached_tokens"]) for t in turns]
    assert cached[1] >= 9 and cached[2] >= 19  # the history, less at most its last token
    assert all(float(t["session_ttft_ms"]) > 0 for t in turns)
    assert summary["mismatches"] == "0" and summary["sessions"] == "2"
    assert float(summary["session_last_over_turn2"]) > 0 and summary["machine"]
