"""bench/prefill.py runs on the tiny model (two lengths, two modes, two requests each) and prints
its fixed format: a line per mode and length, its time the median of its runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from statistics import median

from bench_scripts import BENCH, fields


def test_prefill_smoke(tiny_folder: Path, prebuilt_cpu_kernels: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefill.jsonl"
    argv = [sys.executable, str(BENCH / "prefill.py"), "--model", str(tiny_folder)]
    argv += ["--modes", "float32", "bfloat16", "--tokens", "5", "40", "--repeats", "2"]
    env = os.environ | {"SHOAL_CACHE_DIR": str(prebuilt_cpu_kernels)}
    done = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [fields(x) for x in done.stdout.splitlines() if x.startswith("prefill ")]
    assert [(x["mode"], x["tokens"]) for x in lines] == [
        (mode, n) for mode in ("float32", "bfloat16") for n in ("5", "40")
    ]
    for line in lines:
        runs = [float(r) for r in line["runs"].split(",")]
        assert len(runs) == 2 and abs(float(line["ttft_ms"]) - median(runs)) <= 0.01 < median(runs)
        assert line["setup"].startswith("cpu-") and line["machine"]
    assert len(out.read_text().splitlines()) == 4
