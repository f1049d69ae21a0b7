"""float32's steps of many rows through oneDNN where a start measured it faster
(kernels/f32_many_rows.py, kernels/linear.py): the choice from the times, the measurement's
warm-up, the weight given back exactly from the panels, which rows take which kernel (the
step's `rows` deciding), the gated MLP's activation after oneDNN's product, and a weight update
repacking oneDNN's copy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import f32_many_rows
from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.f32_many_rows import (
    MANY_ROWS,
    MARGIN,
    MIN_LAYER_WEIGHTS,
    choose,
    onednn_from,
    take_many_rows,
)
from shoal.kernels.linear import (
    NEVER,
    DenseLinear,
    GatedPanels,
    PackedLinear,
    onednn_pack,
    onednn_product,
)

FROM = 8  # a small threshold, so that tests reach both sides of it cheaply


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_onednn_is_chosen_only_within_the_margin() -> None:
    assert choose(20.0, 15.0) == MANY_ROWS
    assert choose(20.0, 20.0 * MARGIN) == MANY_ROWS
    assert choose(20.0, 19.0) == NEVER  # faster, but not by the margin
    assert choose(20.0, 25.0) == NEVER


def layer_of_panels(hidden: int = 512) -> list[PackedLinear | GatedPanels]:
    """A layer of SmolLM2's proportions (qkv with a bias, o, gate_up, down), its weights
    MIN_LAYER_WEIGHTS or more at the default hidden size."""
    return [
        PackedLinear(weight(hidden * 5 // 3, hidden, 1), torch.randn(hidden * 5 // 3)),
        PackedLinear(weight(hidden, hidden, 2), None),
        GatedPanels(weight(hidden * 16 // 3, hidden, 3), None),
        PackedLinear(weight(hidden, hidden * 8 // 3, 4), None),
    ]


@pytest.fixture
def scripted_times(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The measurement's passes take the times the test appends, in order (panels, oneDNN,
    panels, ...), instead of the clock's."""
    times: list[float] = []
    monkeypatch.setattr(f32_many_rows, "_seconds", lambda calls: times.pop(0))
    yield times
    assert not times, "the measurement took fewer passes than scripted"


def test_the_measurement_keeps_the_best_time_after_a_warm_up(
    kernels: CpuKernels, scripted_times: list[float]
) -> None:
    layer = layer_of_panels()
    # a slow warm-up of the panels' is left out; oneDNN's best (15) is within the margin of 20
    scripted_times += [1.0, 100.0, 20.0, 30.0, 25.0, 15.0]
    assert onednn_from(layer, runs=2) == MANY_ROWS
    # the panels' best (20) against oneDNN's best (19): not by the margin
    scripted_times += [9.0, 9.0, 20.0, 19.0, 21.0, 40.0]
    assert onednn_from(layer, runs=2) == NEVER


def test_nothing_is_measured_without_panels_or_for_a_small_layer(
    kernels: CpuKernels, scripted_times: list[float]
) -> None:
    dense = [DenseLinear(weight(16, 16, 0), None) for _ in range(4)]
    assert onednn_from(dense) == NEVER
    small = layer_of_panels(hidden=96)
    assert sum(lin.in_features * lin.out_features for lin in small) < MIN_LAYER_WEIGHTS
    assert onednn_from(small) == NEVER  # no time scripted: none taken


def test_a_measurement_on_real_times_picks_one_of_the_two(kernels: CpuKernels) -> None:
    assert onednn_from(layer_of_panels(), runs=1) in (MANY_ROWS, NEVER)


@pytest.mark.parametrize(("n", "k"), [(40, 24), (1000, 96)])
def test_the_panels_give_back_the_weight_exactly(kernels: CpuKernels, n: int, k: int) -> None:
    w = weight(n, k, 5)
    assert torch.equal(PackedLinear(w, None).plain_weight(), w)
    gate_up = weight(2 * n, k, 6)  # n = 40, 1000: whole gated panels of 8, and one ragged
    assert torch.equal(GatedPanels(gate_up, None).plain_weight(), gate_up)


@pytest.mark.parametrize("bias", [False, True])
def test_steps_of_many_rows_take_onednn_and_the_rest_the_panels(
    kernels: CpuKernels, bias: bool
) -> None:
    w, b = weight(72, 40, 7), (torch.randn(72) if bias else None)
    panels_only = PackedLinear(w, b)
    linear = PackedLinear(w, b)
    take_many_rows([linear], FROM)
    assert linear.many_from == FROM and linear.packed is not None
    few, many = torch.randn(FROM - 1, 40), torch.randn(3 * FROM, 40)
    assert torch.equal(linear(few), panels_only(few))
    assert torch.equal(linear(many), onednn_product(many, onednn_pack(w, FROM), b))
    torch.testing.assert_close(linear(many), F.linear(many, w, b), rtol=1e-5, atol=1e-4)
    # the step's rows decide, not x's: a verification's drafts take their row's kernel
    assert torch.equal(linear(many, rows=FROM - 1), panels_only(many))
    assert torch.equal(linear(few, rows=FROM), onednn_product(few, onednn_pack(w, FROM), b))


def test_a_gated_mlp_of_many_rows_activates_onednns_product(kernels: CpuKernels) -> None:
    gate_up = weight(2 * 40, 24, 8)
    panels_only = GatedPanels(gate_up, None)
    linear = GatedPanels(gate_up, None)
    take_many_rows([linear], FROM)
    few, many = torch.randn(FROM - 1, 24), torch.randn(2 * FROM, 24)
    assert torch.equal(linear.silu_mul(few), panels_only.silu_mul(few))
    assert torch.equal(linear(few), panels_only(few))
    product = onednn_product(many, onednn_pack(gate_up, FROM), None)
    assert torch.equal(linear(many), product)
    expected = torch.empty(2 * FROM, 40)
    torch.ops.shoal_cpu.silu_mul(product, expected)
    assert torch.equal(linear.silu_mul(many), expected)
    torch.testing.assert_close(linear.silu_mul(many), silu_mul(many @ gate_up.t()))


def test_a_weight_update_repacks_onednns_copy(kernels: CpuKernels) -> None:
    plain, gated = PackedLinear(weight(32, 16, 9), None), GatedPanels(weight(64, 16, 10), None)
    take_many_rows([plain, gated], FROM)
    new_plain, new_gated = weight(32, 16, 11), weight(64, 16, 12)
    plain.load(new_plain, None)
    gated.load(new_gated, None)
    many = torch.randn(FROM, 16)
    torch.testing.assert_close(plain(many), F.linear(many, new_plain))
    torch.testing.assert_close(gated(many), F.linear(many, new_gated))
    assert torch.equal(plain.plain_weight(), new_plain)
    assert torch.equal(gated.plain_weight(), new_gated)


def test_never_keeps_no_second_copy(kernels: CpuKernels) -> None:
    linear = PackedLinear(weight(32, 16, 13), None)
    take_many_rows([linear], NEVER)
    assert linear.packed is None and linear.many_from == NEVER
