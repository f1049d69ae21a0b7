"""bench/cpu_peak.py builds and prints its fixed format; its figures mean something only from a
full run on an idle machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import fields, load_bench

from shoal.kernels.cpu_features import read_cpu_features


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
    keys = ["threads", "f32_gmacs", "f32_gflops", "int8_gmacs", "int8_over_f32"]
    wide = ["zmm_f32_gmacs", "bf16_dot_gmacs", "vnni_u8_gmacs", "vnni_over_bf16"]
    assert list(lines[0]) == [*keys, *wide, "machine"] and lines[0]["threads"] == "1"
    assert float(lines[0]["f32_gmacs"]) > 0 and float(lines[0]["int8_gmacs"]) > 0
    cpu = read_cpu_features()  # each 512-bit chain runs where the CPU has it, "-" elsewhere
    has = {"zmm_f32": "avx512f" in cpu.flags, "bf16_dot": cpu.bf16, "vnni_u8": cpu.vnni}
    for name, present in has.items():
        value = lines[0][f"{name}_gmacs"]
        assert (float(value) > 0) if present else value == "-"
    both = cpu.bf16 and cpu.vnni
    assert (float(lines[0]["vnni_over_bf16"]) > 0) if both else lines[0]["vnni_over_bf16"] == "-"
    assert json.loads(out.read_text())["threads"] == 1
