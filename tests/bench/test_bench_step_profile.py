"""bench/step_profile.py's buckets: each compiled linear, the gated ones too, counts as a
matmul, and the ops around it land where its docstring says."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench


def test_every_compiled_linear_lands_in_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("step_profile", monkeypatch)
    linears = ("bf16_panel_linear", "bf16_silu_mul", "f32_silu_mul", "shoal_cpu::q8_linear")
    for op in (*linears, "shoal_cpu::q4_linear", "aten::addmm", "aten::mm"):
        assert bench.bucket_of(op) == "matmul", op
    assert bench.bucket_of("shoal_cpu::paged_decode") == "attention"
    assert bench.bucket_of("silu_mul") == "elementwise"  # the element-wise op alone
    assert bench.bucket_of("store_kv") == "kv"
    assert bench.bucket_of("decoder_layers") == "other"  # the C++ chain's own time
