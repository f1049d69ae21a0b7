"""bench/kernels.py runs at tiny shapes (the Triton kernels under the interpreter on CPU) and
prints its fixed format; its figures mean something only on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import fields, load_bench

pytest.importorskip("triton", reason="the triton package is not installed")


def test_kernels_benchmark_smoke(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("kernels", monkeypatch)
    out = tmp_path / "kernels.jsonl"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    lines = [fields(x) for x in capsys.readouterr().out.splitlines() if x.startswith("kernel ")]
    assert [(x["op"], x["impl"]) for x in lines] == [
        ("decode", "triton"), ("decode", "torch"), ("extend", "triton"), ("extend", "torch")
    ]  # fmt: skip
    keys = ["op", "impl", "batch", "context", "ms", "gbps", "tflops", "dtype", "machine"]
    assert all(list(x) == keys for x in lines)
    assert all(float(x["ms"]) > 0 for x in lines)
    assert [x["gbps"] != "-" for x in lines] == [True, True, False, False]
    assert len(out.read_text().splitlines()) == 4
    assert json.loads(out.read_text().splitlines()[0])["op"] == "decode"
