"""bench/serving.py launches shoal on the tiny model, loads it over HTTP streaming, prints its
fixed format and JSON lines; bench/plot.py renders those lines into PNG charts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_offline import fields, load_bench


def test_serving_and_plot_smoke(
    tiny_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serving = load_bench("serving", monkeypatch)
    out = tmp_path / "serving.jsonl"
    argv = ["--launch", "shoal", "--model", str(tiny_folder), "--smoke", "--no-progress"]
    assert serving.main([*argv, "--out", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("serving ")]
    runs = [fields(line) for line in lines]
    assert [(r["system"], r["load"]) for r in runs] == [("shoal", "1"), ("shoal", "2")]
    for run in runs:
        assert run["requests"] == "4" and run["failed"] == "0"
        # --smoke asks for 2-6 tokens per request with ignore_eos: the same seeded total
        assert int(run["output_tokens"]) == int(runs[0]["output_tokens"]) >= 8
        for metric in ("ttft", "itl", "tpot", "e2e"):
            mean, median, p99 = (float(run[f"{metric}_ms_{s}"]) for s in ("mean", "median", "p99"))
            assert 0 < median <= p99 and mean > 0
        assert float(run["e2e_ms_median"]) >= float(run["ttft_ms_median"])
    assert [json.loads(t)["load"] for t in out.read_text().splitlines()] == [1, 2]

    plot = load_bench("plot", monkeypatch)
    assert plot.main([str(out), "--outdir", str(tmp_path)]) == 0
    for name in ("serving_throughput.png", "serving_latency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serving_skips_a_system_that_is_not_installed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = load_bench("serving", monkeypatch)
    monkeypatch.setattr(serving, "missing", lambda system: "not installed here")
    assert serving.main(["--launch", "llamacpp", "--smoke", "--no-progress"]) == 0
    assert "serving system=llamacpp skipped: not installed here" in capsys.readouterr().out
