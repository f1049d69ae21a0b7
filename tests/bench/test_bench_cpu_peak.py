"""bench/cpu_peak.py builds and prints its fixed format; its figures mean something only from a
full run on an idle machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import fields, load_bench


def test_cpu_peak_smoke(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("cpu_peak", monkeypatch)
    threads = torch.get_num_threads()
    out = tmp_path / "peak.jsonl"
    assert bench.main(["--threads", "1", "--iters", "2000", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the caller's thread count comes back
    lines = [fields(x) for x in capsys.readouterr().out.splitlines() if x.startswith("cpu_peak ")]
    assert len(lines) == 1
    keys = ["threads", "f32_gmacs", "f32_gflops", "int8_gmacs", "int8_over_f32", "machine"]
    assert list(lines[0]) == keys and lines[0]["threads"] == "1"
    assert float(lines[0]["f32_gmacs"]) > 0 and float(lines[0]["int8_gmacs"]) > 0
    assert json.loads(out.read_text())["threads"] == 1
