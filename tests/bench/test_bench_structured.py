"""bench/structured.py runs (`--smoke` on the tiny model: 1 and 2 streams, one round) and
prints its fixed format: a line per kind and stream count with a positive rate, a ratio per
stream count, and the compile times."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCH, fields


def test_structured_smoke(tiny_folder: Path, prebuilt_cpu_kernels: Path) -> None:
    argv = [sys.executable, str(BENCH / "structured.py"), "--smoke", "--model", str(tiny_folder)]
    env = os.environ | {"SHOAL_CACHE_DIR": str(prebuilt_cpu_kernels)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    runs = [fields(line) for line in lines if line.startswith("structured kind=")]
    assert [(r["kind"], r["streams"]) for r in runs] == [
        (kind, streams)
        for streams in ("1", "2")
        for kind in ("plain", "json_schema", "json_bounded", "regex")
    ]
    assert all(float(r["output_tok_s"]) > 0 for r in runs)
    ratios = [fields(line) for line in lines if line.startswith("structured ratio ")]
    assert [r["streams"] for r in ratios] == ["1", "2"]
    [compiled] = [fields(line) for line in lines if line.startswith("structured compile ")]
    assert set(compiled) >= {"first_grammar_ms", "json_schema_ms", "cached_ms", "regex_ms"}
