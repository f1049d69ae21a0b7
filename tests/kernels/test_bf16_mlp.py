"""A SiLU-gated MLP whose two matmuls are bfloat16 keeps its activation bfloat16 between them
(kernels/bf16_mlp.py, models/dense_mlp.py, silu_mul over bfloat16 in csrc/elementwise.cpp): the
same bits as the float32 path it replaces (the product widened, silu_mul in float32, the
activation rounded at the down's call), for bfloat16 weights and for int8's steps of many rows;
where it does not apply (a bias, the lm_head, int8's few rows, float32, bfloat16 panels whose
products stay float32) the usual path. The pair tests take oneDNN's form (`onednn_form`), the
one a CPU with AMX runs, wherever the CPU would take the compiled panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import bf16_linear
from shoal.kernels.bf16_linear import Bf16Head, Bf16Linear, onednn_bf16_available
from shoal.kernels.bf16_mlp import bf16_pair
from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.elementwise import CompiledElementwise, TorchElementwise
from shoal.kernels.int8_gated import GatedInt8Linear
from shoal.kernels.int8_rows import ManyRows
from shoal.kernels.quant import Int8Linear
from shoal.models.dense_mlp import dense_mlp
from shoal.models.weights import DenseWeights

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16_available(), reason="oneDNN has no bfloat16 matmul on this CPU"
)


@pytest.fixture
def onednn_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bfloat16 linears built now take oneDNN's matmul, not the compiled panels."""
    monkeypatch.setattr(bf16_linear, "bf16_panels_available", lambda: False)


@pytest.mark.parametrize(("rows", "inter"), [(1, 64), (3, 37), (40, 1536), (17, 16), (5, 1)])
def test_bf16_silu_mul_is_the_float32_ones_rounded(
    kernels: CpuKernels, rows: int, inter: int
) -> None:
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).bfloat16()
    gate_up[0, 0] = float("inf")
    wide = torch.empty(rows, inter)
    kernels.silu_mul(gate_up.float(), wide)
    narrow = torch.empty(rows, inter, dtype=torch.bfloat16)
    kernels.silu_mul(gate_up, narrow)
    assert torch.equal(narrow.view(torch.int16), wide.bfloat16().view(torch.int16))
    strided = torch.empty(rows, 3 * inter, dtype=torch.bfloat16)[:, :inter]  # rows apart
    kernels.silu_mul(gate_up, strided)
    assert torch.equal(strided, narrow)


def test_bf16_silu_mul_refuses_mixed_types(kernels: CpuKernels) -> None:
    with pytest.raises(RuntimeError, match="gate_up"):
        kernels.silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 4))


def unfused(mlp: DenseWeights, x: torch.Tensor, kernels: CpuKernels) -> torch.Tensor:
    """The path before: the gate_up's float32 product (or a gated one's activation), silu_mul in
    float32, the down taking float32."""
    ops = CompiledElementwise(kernels)
    if isinstance(mlp.gate_up, GatedInt8Linear):
        return mlp.down(mlp.gate_up.silu_mul(x))
    return mlp.down(ops.silu_mul(mlp.gate_up(x)))


@pytest.mark.usefixtures("onednn_form")
@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 64, 189])
def test_bf16_weights_give_the_unfused_bits(kernels: CpuKernels, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    mlp = DenseWeights(
        Bf16Linear(torch.randn(2 * 96, 48, generator=gen) * 0.2, None),
        Bf16Linear(torch.randn(48, 96, generator=gen) * 0.2, None),
    )
    x = torch.randn(rows, 48, generator=gen)
    assert bf16_pair(mlp.gate_up, mlp.down, x) is not None
    got = dense_mlp(mlp, x, CompiledElementwise(kernels), "silu")
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    assert torch.equal(got, unfused(mlp, x, kernels))
    reference = dense_mlp(mlp, x, TorchElementwise(), "silu")  # the torch ops: no pair
    gate, up = mlp.gate_up(x).chunk(2, dim=-1)
    assert torch.equal(reference, mlp.down(F.silu(gate) * up))


@pytest.mark.usefixtures("onednn_form")
@needs_onednn_bf16
@pytest.mark.parametrize("rows", [3, 4, 70])
def test_int8_many_rows_give_the_unfused_bits(kernels: CpuKernels, rows: int) -> None:
    """int8 with its many-row steps in bfloat16 from 4 rows: 3 take the blocks, as before."""
    gen = torch.Generator().manual_seed(rows)
    form = ManyRows(4, True)
    mlp = DenseWeights(
        GatedInt8Linear(torch.randn(2 * 64, 64, generator=gen) * 0.1, None, form=form),
        Int8Linear(torch.randn(64, 64, generator=gen) * 0.1, None, form=form),
    )
    x = torch.randn(rows, 64, generator=gen)
    assert (bf16_pair(mlp.gate_up, mlp.down, x) is not None) == (rows >= 4)
    got = dense_mlp(mlp, x, CompiledElementwise(kernels), "silu")
    assert torch.equal(got, unfused(mlp, x, kernels))


@pytest.mark.usefixtures("onednn_form")
@needs_onednn_bf16
def test_what_keeps_the_float32_path(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(32, 16, generator=gen), torch.randn(8, 16, generator=gen)
    plain = Bf16Linear(weight, None)
    assert bf16_pair(plain, Bf16Linear(weight.T.contiguous(), torch.ones(16)), x) is None
    assert bf16_pair(plain, Bf16Head(weight.T.contiguous(), None), x) is None
    assert bf16_pair(plain, torch.nn.Linear(32, 16), x) is None
    few = Int8Linear(weight.T.contiguous(), None, form=ManyRows(64, True))
    assert bf16_pair(plain, few, x) is None  # 8 rows: int8's blocks
    never = Int8Linear(weight.T.contiguous(), None, form=ManyRows(4, False))
    assert bf16_pair(plain, never, x) is None  # float32 panels
    assert bf16_pair(plain, Bf16Linear(weight.T.contiguous(), None), x) is not None


def test_bf16_panels_keep_the_float32_path(kernels: CpuKernels) -> None:
    """A bfloat16 linear in the compiled panels' form (bf16_panels.cpp) gives its product in
    float32: no pair, the usual path's bits."""
    if not bf16_linear.bf16_panels_available():
        pytest.skip("the compiled bfloat16 panels need AVX512-BF16 and no AMX")
    gen = torch.Generator().manual_seed(3)
    mlp = DenseWeights(
        Bf16Linear(torch.randn(2 * 96, 48, generator=gen) * 0.2, None),
        Bf16Linear(torch.randn(48, 96, generator=gen) * 0.2, None),
    )
    x = torch.randn(9, 48, generator=gen)
    assert mlp.gate_up.panels is not None and bf16_pair(mlp.gate_up, mlp.down, x) is None
    with pytest.raises(RuntimeError, match="float32"):
        mlp.gate_up.product(x)
    got = dense_mlp(mlp, x, CompiledElementwise(kernels), "silu")
    assert torch.equal(got, unfused(mlp, x, kernels))
