"""bench/linear_kinds.py runs (one row count, two repeats) and prints its fixed format: both
parts, a positive time for each kind it measured, the CPU's features named, and no column
for a kind this CPU cannot run."""

from __future__ import annotations

import pytest
from bench_scripts import fields, load_bench

from shoal.kernels.bf16_linear import onednn_bf16_available


def test_linear_kinds_smoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench("linear_kinds", monkeypatch)
    assert bench.main(["--rows", "2", "--repeats", "2"]) == 0
    lines = [fields(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["part"], int(line["rows"])) for line in lines] == [("layers", 2), ("lm_head", 2)]
    for line in lines:
        for kind in ("onednn", "f_linear"):
            assert float(line[f"{kind}_ms"]) > 0
        # oneDNN's bfloat16 where it multiplies bfloat16 here (not on AVX2 alone)
        assert ("onednn_bf16_ms" in line) == onednn_bf16_available()
        assert float(line.get("onednn_bf16_ms", 1.0)) > 0
        # shoal's bfloat16 panels where the CPU has AVX512-BF16 (csrc/bf16_panels.cpp)
        assert ("bf16_panels_ms" in line) == ("avx512_bf16" in line["isa"].split("+"))
        assert float(line.get("bf16_panels_ms", 1.0)) > 0
        assert line["isa"] and line["machine"]
