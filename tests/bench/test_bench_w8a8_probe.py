"""bench/w8a8_probe.py and its kernels (bench/w8a8_probe.cpp): `u8_linear`'s product is the
exact one of its rounding (the float64 product of each row's blocks of 32 rounded unsigned from
their minimum and the blocks' weights), for Q4 and Q8 blocks, any row count, channels past a
panel's 16, a bias and bfloat16 rows, a row's the same whatever rows share its call; bad
arguments are refused; a short run prints its lines, and a CPU without VNNI a skip line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_scripts import fields, load_bench

from shoal.kernels import cpu_features
from shoal.kernels.quant import exact_q4_blocks, q8_blocks

FEATURES = cpu_features.read_cpu_features()
NEEDS = pytest.mark.skipif(
    not (FEATURES.vnni and FEATURES.bf16), reason="the probe needs AVX512-VNNI and AVX512-BF16"
)


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Any:
    bench = load_bench("w8a8_probe", monkeypatch)
    bench.load_probe()
    return bench


def blocks_of(kind: str, n: int, k: int, gen: torch.Generator, bench: Any) -> Any:
    if kind == "q8":
        return q8_blocks(torch.randn(n, k, generator=gen))
    blocks = exact_q4_blocks(bench.q4_weight(n, k, gen))
    assert blocks is not None
    return blocks


@NEEDS
@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("shape", [(40, 64), (200, 96)])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_the_product_is_the_rounded_rows_times_the_weights(
    probe: Any, rows: int, shape: tuple[int, int], kind: str
) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    blocks = blocks_of(kind, n, k, gen, probe)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen) * 3
    x[:, 5] += 20  # an outlier channel: its block gets coarse steps, the others do not
    panels = probe.pack_u8_panels(blocks)
    for rows_in in (x, x.bfloat16()):  # bfloat16 rows: rounded from their own values
        want = probe.rounded_rows(rows_in) @ blocks.dequantize().double().T + bias.double()
        got = probe.u8_product(rows_in, panels, n, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()


@NEEDS
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(probe: Any) -> None:
    """64 rows (tiles of 4 and a remainder), a block of equal values among them."""
    gen = torch.Generator().manual_seed(3)
    blocks = q8_blocks(torch.randn(48, 576, generator=gen))
    panels = probe.pack_u8_panels(blocks)
    x = torch.randn(67, 576, generator=gen)
    x[2, :32] = 0.75
    many = probe.u8_product(x, panels, 48)
    for i in (0, 2, 63, 66):
        assert torch.equal(probe.u8_product(x[i : i + 1], panels, 48), many[i : i + 1])
    want = probe.rounded_rows(x) @ blocks.dequantize().double().T
    assert (many.double() - want).abs().max() <= 2e-6 * want.abs().max()


def test_the_panels_hold_the_blocks_integers_and_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("w8a8_probe", monkeypatch)
    blocks = exact_q4_blocks(bench.q4_weight(20, 64, torch.Generator().manual_seed(4)))
    assert blocks is not None
    packed = bench.pack_u8_panels(blocks)
    assert packed.shape == (2, 2, 704) and packed.dtype == torch.uint8
    quads = packed[:, :, :512].contiguous().view(torch.int8).view(2, 2, 8, 16, 4)
    values = quads.permute(0, 3, 1, 2, 4).reshape(32, 64)
    assert torch.equal(values[:20], blocks.values().to(torch.int8))
    assert not values[20:].any()  # channels past N
    scales = packed[:, :, 512:].contiguous().view(torch.float32).view(2, 2, 3, 16)
    assert torch.equal(scales[:, :, 0], blocks.d) and torch.equal(scales[:, :, 2], blocks.m)
    sums = values.view(2, 16, 2, 32).sum(-1).permute(0, 2, 1).float()
    assert torch.equal(scales[:, :, 1], blocks.d * sums)


@NEEDS
def test_bad_arguments_are_refused(probe: Any) -> None:
    panels = probe.pack_u8_panels(q8_blocks(torch.randn(16, 64)))
    op = torch.ops.shoal_probe.u8_linear
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 48), panels, None, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="panels"):
        op(torch.randn(2, 32), panels, None, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 64), panels, torch.randn(15), torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="out must be"):
        op(torch.randn(2, 64), panels, None, torch.empty(3, 16))
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.randn(2, 64).double(), panels, None, torch.empty(2, 16))


@NEEDS
def test_a_short_probe_prints_its_lines(
    probe: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "probe.jsonl"
    argv = ["--rows", "8", "--layers", "1", "--reps", "200", "--out", str(out)]
    assert probe.main(argv) == 0
    assert torch.get_num_threads() == threads
    lines = [fields(x) for x in capsys.readouterr().out.splitlines() if x.startswith("w8a8_probe")]
    assert [line["part"] for line in lines] == ["tile", "layers"]
    assert list(lines[0]) == ["part", "u8_gmacs", "bf16_gmacs", "u8_over_bf16", "machine"]
    keys = ["part", "rows", "layers", "u8_ms", "bf16_panels_ms", "blocks_ms", "u8_over_bf16"]
    assert list(lines[1]) == [*keys, "max_rel_err", "machine"] and lines[1]["rows"] == "8"
    assert float(lines[1]["max_rel_err"]) < 1e-5  # float32 sums of exact int32 dots
    assert float(lines[0]["u8_gmacs"]) > 0 and float(lines[1]["blocks_ms"]) > 0
    assert [json.loads(x)["part"] for x in out.read_text().splitlines()] == ["tile", "layers"]


def test_a_cpu_without_vnni_gets_a_skip_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("w8a8_probe", monkeypatch)
    avx2 = dataclasses.replace(FEATURES, flags=frozenset({"avx2"}))
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: avx2)
    assert bench.main(["--rows", "4", "--layers", "1"]) == 0
    assert capsys.readouterr().out.startswith("w8a8_probe skipped: needs AVX512-VNNI")
