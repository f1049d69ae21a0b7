"""bench/kernels.py runs at tiny shapes (the Triton kernels under the interpreter on CPU; the
compiled CPU kernels beside the reference) and prints its fixed format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import fields, load_bench

from shoal.kernels.cpu_kernels import CpuKernels


def test_kernels_benchmark_smoke(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton", reason="the triton package is not installed")
    bench = load_bench("kernels", monkeypatch)
    out = tmp_path / "kernels.jsonl"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    lines = [fields(x) for x in capsys.readouterr().out.splitlines() if x.startswith("kernel ")]
    assert [(x["op"], x["impl"]) for x in lines] == [
        ("decode", "triton"), ("decode", "torch"), ("extend", "triton"), ("extend", "torch")
    ]  # fmt: skip
    keys = ["op", "impl", "batch", "context", "ms", "gbps", "tflops", "dtype", "layers"]
    keys += ["kv_memory", "pool_tokens", "machine"]
    assert all(list(x) == keys for x in lines)
    assert all(float(x["ms"]) > 0 for x in lines)
    assert [x["gbps"] != "-" for x in lines] == [True, True, False, False]
    assert len(out.read_text().splitlines()) == 4
    assert json.loads(out.read_text().splitlines()[0])["op"] == "decode"


def test_kernels_benchmark_cpu_kernels(
    kernels: CpuKernels, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled kernels beside the reference, a bfloat16 KV, two layers' caches: decode and
    extend lines."""
    bench = load_bench("kernels", monkeypatch)
    argv = ["--device", "cpu", "--dtype", "bfloat16", "--batch", "2", "--extend-batch", "1"]
    argv += ["--layers", "2"]
    assert bench.main([*argv, "--context", "40", "--iters", "1", "--page-size", "4"]) == 0
    lines = [fields(x) for x in capsys.readouterr().out.splitlines() if x.startswith("kernel ")]
    assert [(x["op"], x["impl"]) for x in lines] == [
        ("decode", "torch"), ("decode", "cpu"), ("extend", "torch"), ("extend", "cpu")
    ]  # fmt: skip
    assert all(float(x["ms"]) > 0 and x["dtype"] == "bfloat16" for x in lines)
    assert all(x["layers"] == "2" for x in lines)


def test_kernels_benchmark_kv_memory(
    kernels: CpuKernels, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kv-memory torch pool: each shape with the caches from torch's allocator, then from the
    KV pool's (models/huge_pages.py), on a pool of --pool-tokens slots; the lines say which."""
    bench = load_bench("kernels", monkeypatch)
    argv = ["--device", "cpu", "--impls", "cpu", "--batch", "2", "--extend-batch", "0"]
    argv += ["--context", "40", "--iters", "1", "--pool-tokens", "20000"]
    assert bench.main([*argv, "--kv-memory", "torch", "pool"]) == 0
    lines = [fields(x) for x in capsys.readouterr().out.splitlines() if x.startswith("kernel ")]
    decodes = [x for x in lines if x["op"] == "decode"]
    assert [(x["kv_memory"], x["pool_tokens"]) for x in decodes] == [
        ("torch", "20000"), ("pool", "20000")
    ]  # fmt: skip
    assert all(float(x["ms"]) > 0 for x in lines)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--kv-memory", "pool"])
