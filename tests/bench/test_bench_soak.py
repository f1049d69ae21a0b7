"""bench/soak.py runs (a few seconds, 2 clients, the tiny model) and finds nothing leaked."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_bench


def test_soak_benchmark_smoke(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("soak", monkeypatch)
    args = ["--model", str(tiny_folder), "--minutes", "0.2", "--sample-every-s", "4"]
    args += ["--clients", "3", "--warm-up-minutes", "0", "--flush-every-s", "2"]
    args += ["--update-every-s", "5", "--flat", "10", "--quiet"]  # seconds say nothing of flat
    assert bench.main(args) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [line[0] for line in lines][-1] == "soak_summary"
    assert len([line for line in lines if line[0] == "soak"]) >= 2
    fields = [dict(f.split("=", 1) for f in line[1:]) for line in lines]
    for minute in fields[:-1]:
        assert float(minute["rss_mb"]) > 0 and int(minute["fds"]) > 0
        assert int(minute["threads"]) > 0 and minute["failed"] == "0"
    summary = fields[-1]
    assert summary["leaked"] == "nothing" and summary["failed"] == "none"
    assert float(summary["rss_peak_mb"]) > 0 and abs(float(summary["threads_drift"])) < 1
    done = dict(item.split(":") for item in summary["ops"].split(","))
    assert {"chat", "session", "websocket", "leave", "abort", "flush_cache"} <= done.keys()
