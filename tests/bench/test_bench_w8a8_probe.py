"""bench/w8a8_probe.py: its W8A8 product is the float64 reference's, its lines keep their
format, and a CPU without VNNI and BF16 gets a skip line, not a crash."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from bench_scripts import fields, load_bench

from shoal.kernels import cpu_features

FEATURES = cpu_features.read_cpu_features()
NEEDS = pytest.mark.skipif(
    not (FEATURES.vnni and FEATURES.bf16), reason="the probe needs AVX512-VNNI and AVX512-BF16"
)


@NEEDS
def test_a_short_probe_matches_its_reference_and_prints_its_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("w8a8_probe", monkeypatch)
    threads = torch.get_num_threads()
    out = tmp_path / "probe.jsonl"
    argv = ["--rows", "8", "--layers", "1", "--reps", "200", "--out", str(out)]
    assert bench.main(argv) == 0
    assert torch.get_num_threads() == threads
    lines = [fields(x) for x in capsys.readouterr().out.splitlines() if x.startswith("w8a8_probe")]
    assert [line["part"] for line in lines] == ["tile", "layers"]
    assert list(lines[0]) == ["part", "u8_gmacs", "bf16_gmacs", "u8_over_bf16", "machine"]
    keys = ["part", "rows", "layers", "u8_ms", "bf16_ms", "u8_over_bf16", "max_rel_err"]
    assert list(lines[1]) == [*keys, "machine"] and lines[1]["rows"] == "8"
    assert float(lines[1]["max_rel_err"]) < 1e-5  # float32 sums of exact int32 dots
    assert float(lines[0]["u8_gmacs"]) > 0 and float(lines[1]["bf16_ms"]) > 0
    assert [json.loads(x)["part"] for x in out.read_text().splitlines()] == ["tile", "layers"]


@NEEDS
def test_the_reference_is_the_dequantized_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's layout read back: its dense weights times dw are what the panels hold."""
    bench = load_bench("w8a8_probe", monkeypatch)
    w = bench.quantized(32, 64, torch.Generator().manual_seed(5))
    xq = torch.randint(0, 256, (4, 64), dtype=torch.uint8, generator=torch.Generator())
    ones, zeros = torch.ones(4, 2), torch.zeros(4, 2)
    weight = w["dense"].double() * w["dw"].permute(0, 2, 1).reshape(32, 2, 1).double()
    want = xq.double() @ weight.reshape(32, 64).T  # dx = 1, mx = 0: the plain product
    assert torch.allclose(bench.reference(xq, ones, zeros, w), want)
    # mx = 1: each block's cw added once
    assert torch.allclose(
        bench.reference(xq, ones, torch.ones(4, 2), w) - want,
        w["cw"].permute(0, 2, 1).reshape(32, 2).double().sum(-1).expand(4, 32),
    )


def test_a_cpu_without_vnni_gets_a_skip_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("w8a8_probe", monkeypatch)
    avx2 = dataclasses.replace(FEATURES, flags=frozenset({"avx2"}))
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: avx2)
    assert bench.main(["--rows", "4", "--layers", "1"]) == 0
    assert capsys.readouterr().out.startswith("w8a8_probe skipped: needs AVX512-VNNI")
