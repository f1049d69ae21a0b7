"""bench/speculative.py runs (`--smoke` on the tiny model: 1 and 2 streams, one round, no
peer, one stream running two prompts in turn, speculating while one request runs) and prints
its fixed format: a line per workload, stream count and setting with a positive rate (one
stream: each prompt's too; two: the head's and the tail's, two requests and one running), and
a ratio per workload and stream count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCH, fields


def test_speculative_smoke(tiny_folder: Path, prebuilt_cpu_kernels: Path) -> None:
    argv = [sys.executable, str(BENCH / "speculative.py"), "--smoke", "--model", str(tiny_folder)]
    env = os.environ | {"SHOAL_CACHE_DIR": str(prebuilt_cpu_kernels)}
    env.pop("SHOAL_BENCH_LLAMACPP_PYTHON", None)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    runs = [fields(line) for line in lines if line.startswith("speculative system=")]
    assert [(r["workload"], r["streams"], r["spec"]) for r in runs] == [
        (workload, streams, spec)
        for streams in ("1", "2")
        for workload in ("copy", "prose")
        for spec in ("off", "on")
    ]
    assert all(float(r["output_tok_s"]) > 0 and r["system"] == "shoal" for r in runs)
    assert all(float(r["decode_tok_s"]) > 0 for r in runs)
    for run in runs:  # one stream: its two prompts' own rates; N streams: none
        each = run["per_prompt"].split(",") if run["streams"] == "1" else []
        assert len(each) == (2 if run["streams"] == "1" else 0) and all(float(x) > 0 for x in each)
        assert run["streams"] == "1" or "per_prompt" not in run
        parts = [float(run[f"{part}_tok_s"]) for part in ("head", "tail") if f"{part}_tok_s" in run]
        assert len(parts) == (0 if run["streams"] == "1" else 2) and all(x > 0 for x in parts)
    ratios = [fields(line) for line in lines if line.startswith("speculative ratio ")]
    assert [(r["workload"], r["streams"]) for r in ratios] == [
        (workload, streams) for streams in ("1", "2") for workload in ("copy", "prose")
    ]
    assert all(float(r["on_over_off"]) > 0 and float(r["decode_on_over_off"]) > 0 for r in ratios)
    for ratio in ratios:
        split = [
            float(ratio[f"{p}_on_over_off"])
            for p in ("head", "tail")
            if f"{p}_on_over_off" in ratio
        ]
        assert len(split) == (0 if ratio["streams"] == "1" else 2) and all(x > 0 for x in split)
        assert int(ratio["verifications"]) >= 0


def test_speculative_control_says_so(tiny_folder: Path, prebuilt_cpu_kernels: Path) -> None:
    """`--control` (an A/A run: both turns without speculation) says so on every line."""
    argv = [sys.executable, str(BENCH / "speculative.py"), "--smoke", "--control"]
    argv += ["--model", str(tiny_folder)]
    env = os.environ | {"SHOAL_CACHE_DIR": str(prebuilt_cpu_kernels)}
    env.pop("SHOAL_BENCH_LLAMACPP_PYTHON", None)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [fields(line) for line in done.stdout.splitlines() if line.startswith("speculative ")]
    assert len(lines) == 12 and all(line.get("control") == "1" for line in lines)
