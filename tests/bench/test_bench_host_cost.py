"""bench/host_cost.py runs (`--smoke`: batches 1 and 4, 8 steps, both paths, greedy and
sampled, a fake 1 ms device) and prints its fixed format: a line per window whose per-thread
CPU times are there and positive, and a fit per path and sampling.

In a subprocess: the benchmark patches shoal's forward and executor seams for its whole
process, sets torch's thread count and TRITON_INTERPRET, none of which may leak into the
tests' process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCH, fields

ROLES = ("loop", "launch", "completion")


def test_host_cost_smoke(prebuilt_cpu_kernels: Path, tmp_path: Path) -> None:
    out = tmp_path / "host_cost.jsonl"
    argv = [sys.executable, str(BENCH / "host_cost.py"), "--smoke", "--device-ms", "1"]
    env = os.environ | {"SHOAL_CACHE_DIR": str(prebuilt_cpu_kernels)}
    done = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    windows = [fields(line) for line in lines if line.startswith("host_cost ")]
    fits = [fields(line) for line in lines if line.startswith("host_cost_fit ")]

    runs = [(w["path"], w["sampling"], int(w["batch"])) for w in windows]
    assert runs == [
        (path, sampling, batch)
        for path in ("cpu", "graph")
        for sampling in ("greedy", "sampled")
        for batch in (1, 4)
    ]
    for w in windows:
        assert int(w["steps"]) >= 8 and float(w["device_ms"]) == 1.0
        assert float(w["step_ms"]) > 0 and float(w["cpu_ms"]) > 0
        for role in ROLES:  # every thread does some work in every step
            assert float(w[f"{role}_us_per_seq"]) > 0, (role, w)
        assert math.isfinite(float(w["other_us_per_seq"]))
        assert float(w["forward_us"]) > 0  # the trivial forward ran, and was counted apart
        assert 0 < float(w["device_busy"]) <= 1.0
        assert w["machine"] and w["setup"].startswith("cpu-float32-")

    assert [(f["path"], f["sampling"]) for f in fits] == [
        (path, sampling) for path in ("cpu", "graph") for sampling in ("greedy", "sampled")
    ]
    for f in fits:
        assert f["batches"] == "1,4"
        for prefix in ("", *(f"{role}_" for role in ROLES)):
            assert math.isfinite(float(f[f"{prefix}fixed_ms"]))
            assert math.isfinite(float(f[f"{prefix}us_per_seq"]))

    saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(saved) == len(windows) + len(fits)
    assert saved[0]["path"] == "cpu" and saved[0]["batch"] == 1
