"""bench/act8_emulation.py: its rotation is orthonormal, its roundings (symmetric and
unsigned from a minimum) are 8-bit, a rotation
spreads an outlier channel as the emulation counts on, and a short run prints its line and
leaves the model builder as it found it."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import fields, load_bench

from shoal.kernels import linear as linear_kinds
from shoal.models import weights as model_weights


def test_hadamard_is_orthonormal_and_rounding_keeps_the_8_bit_grid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_bench("act8_emulation", monkeypatch)
    h = bench.hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    twice = bench.rotated(bench.rotated(x, 64), 64)
    assert torch.allclose(twice, x, atol=1e-5)  # H is its own inverse
    on_grid = torch.arange(-127, 129, dtype=torch.float32)[:128].reshape(1, 128) * 0.5
    assert torch.equal(bench.rounded(on_grid, 0), on_grid)  # largest |x| 63.5 = 127 steps
    for block in (0, 32):
        err = (bench.rounded(x, block) - x).abs()
        groups = x.reshape(3, -1, block or 128).abs().amax(-1, keepdim=True)
        assert (err.reshape(3, -1, block or 128) <= groups / 127 / 2 + 1e-7).all()


def test_unsigned_rounding_keeps_its_grid_and_halves_a_one_sided_blocks_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--act-asym: 256 steps from the block's minimum; on values that are mostly one side of 0
    (a SiLU's outputs, down_proj's inputs) that is about half the symmetric rounding's step."""
    bench = load_bench("act8_emulation", monkeypatch)
    on_grid = torch.arange(256, dtype=torch.float32).reshape(1, 256) * 0.25 - 3.0
    assert torch.equal(bench.rounded_unsigned(on_grid, 0), on_grid)  # min -3, 255 steps of 1/4
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    for block in (0, 32):
        err = (bench.rounded_unsigned(x, block) - x).abs().reshape(4, -1, block or 256)
        g = x.reshape(4, -1, block or 256)
        step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 255
        assert (err <= step / 2 + 1e-6).all()
    silu = torch.nn.functional.silu(x * 3)  # >= -0.28, up to ~9
    unsigned = (bench.rounded_unsigned(silu, 32) - silu).norm()
    assert unsigned < (bench.rounded(silu, 32) - silu).norm() * 0.7
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    scheme = bench.Scheme(0, 0, 32, -1, act_asym=True)
    got = bench.Act8Linear(w, None, scheme)(silu)
    assert torch.allclose(got, bench.rounded_unsigned(silu, 32) @ w.T, atol=1e-4)


def test_a_rotation_spreads_an_outlier_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("act8_emulation", monkeypatch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 576, generator=g)
    x[:, 7] = 200.0  # one channel far outside the rest, as after a norm
    w = torch.randn(64, 576, generator=g) / 24
    exact = x @ w.T
    errors = {}
    for rotate in (0, 64):
        scheme = bench.Scheme(rotate, 0, 0, 0)
        errors[rotate] = (bench.Act8Linear(w, None, scheme)(x) - exact).norm() / exact.norm()
    assert errors[64] < errors[0] / 3


def test_only_the_shapes_asked_for_are_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("act8_emulation", monkeypatch)
    make = bench.act8_factory(bench.Scheme(64, 0, 0, -1, only=frozenset({"8x64"})))
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    emulated = make("dense", w, None)
    assert isinstance(emulated, bench.Act8Linear)
    assert torch.equal(emulated.weight, bench.rotated(w, 64))  # -1: the weights not rounded
    assert isinstance(make("dense", w[:4], None), linear_kinds.DenseLinear)
    assert isinstance(make("packed", w, None), linear_kinds.PackedLinear)


def test_a_short_run_prints_its_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("act8_emulation", monkeypatch)
    argv = ["--rotate", "64", "--rotate-down", "512", "--act-block", "64", "--tokens", "40"]
    assert bench.main([*argv, "--chunk", "16"]) == 0
    line = fields(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["rotate"] == "64" and line["rotate_down"] == "512" and line["tokens"] == "40"
    assert 0.0 < float(line["top1_agreement"]) <= 1.0 and line["verdict"] in ("pass", "fail")
    assert line["only"] == "all"
    assert model_weights.make_linear is linear_kinds.make_linear  # put back
    assert bench.main(["--only", "3072x576", "--weight-block", "-1", "--tokens", "40"]) == 0
    line = fields(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["only"] == "3072x576" and line["weight_block"] == "-1"
    assert line["act_asym"] == "False"
    assert bench.main(["--act-asym", "--act-block", "32", "--tokens", "40", "--chunk", "16"]) == 0
    line = fields(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["act_asym"] == "True" and line["act_block"] == "32"
