"""bench/serving.py launches shoal on the tiny model, loads it over HTTP streaming, prints its
fixed format and JSON lines; bench/plot.py renders those lines into PNG charts; vLLM is
launched as bench/launch.py launches it (a fake server standing in), or skipped."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from bench_scripts import fields, load_bench
from fake_vllm_package import fake_vllm


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
    monkeypatch.setattr(serving, "missing", lambda system, config: "not installed here")
    assert serving.main(["--launch", "llamacpp", "--smoke", "--no-progress"]) == 0
    assert "serving system=llamacpp skipped: not installed here" in capsys.readouterr().out


def test_serving_skips_vllm_without_its_python(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = load_bench("serving", monkeypatch)
    monkeypatch.setenv("SHOAL_BENCH_VLLM_PYTHON", str(tmp_path / "no-python"))
    assert serving.main(["--launch", "vllm", "--smoke", "--no-progress"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("serving system=vllm skipped: ")
    assert "no-python does not run (FileNotFoundError" in out
    assert out.endswith("(from $SHOAL_BENCH_VLLM_PYTHON)")


def test_serving_launches_vllm_from_its_python(
    tiny_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = fake_vllm(tmp_path, monkeypatch)  # its api_server checks each request's fields
    serving = load_bench("serving", monkeypatch)
    argv = ["--launch", "vllm", "--model", str(tiny_folder), "--smoke", "--no-progress"]
    assert serving.main([*argv, "--vllm-python", sys.executable, "--threads", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("serving ")]
    runs = [fields(line) for line in lines]
    assert [(r["system"], r["load"]) for r in runs] == [("vllm", "1"), ("vllm", "2")]
    assert all(r["failed"] == "0" and int(r["output_tokens"]) >= 8 for r in runs)
    seen = json.loads(record.read_text())
    assert seen["argv"]["model"] == str(tiny_folder) and seen["argv"]["dtype"] == "float32"
    assert seen["argv"]["max_model_len"] == "2048" and seen["argv"]["host"] == "127.0.0.1"
    assert seen["env_bind"] == "0-1" and seen["cwd"] == tempfile.gettempdir()


def test_launch_commands_and_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    launch = load_bench("launch", monkeypatch)
    config = launch.LaunchConfig(None, 2, "int8", ("--chunk-size", "256"))
    cmd = launch.command("shoal", config, 8000)
    assert " ".join(cmd[1:]) == (
        "-m shoal serve --port 8000 --num-threads 2 --quantization int8 --chunk-size 256"
    )
    assert config.label("shoal") == "shoal-int8_--chunk-size_256"
    assert config.label("vllm") == "vllm"
    assert launch.LaunchConfig(None, 2).label("shoal") == "shoal"
    assert launch.STARTUP_TIMEOUT_S["vllm"] >= 600


def test_request_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    serving = load_bench("serving_requests", monkeypatch)
    req = serving.Request("a b c", 5)
    vllm = serving.request_body("vllm", "m", req, [])
    assert vllm["ignore_eos"] and vllm["min_tokens"] == 5 and vllm["max_tokens"] == 5
    assert vllm["stream_options"] == {"include_usage": True} and vllm["temperature"] == 0.0
    shoal = serving.request_body("shoal", "m", req, [])
    assert shoal["ignore_eos"] and "min_tokens" not in shoal
    llamacpp = serving.request_body("llamacpp", "m", req, [2])
    assert "ignore_eos" not in llamacpp and llamacpp["logit_bias"] == {"2": -100.0}
