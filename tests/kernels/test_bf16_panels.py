"""The bfloat16 panels (csrc/bf16_panels.cpp, `bf16_panel_linear`; bf16_linear.py's form on a
CPU with AVX512-BF16 and no AMX): the product of x rounded to bfloat16 and the weight in
bfloat16, summed in float32 and never rounded to bfloat16; a row's bits whatever shares its step
or however many threads run; x given in float32 rounded as torch rounds it; the layout; the
refusals; and `Bf16Linear` on them (a bias, a weight update, the head)."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.bf16_linear import PANEL, Bf16Head, Bf16Linear, pack_bf16_panels
from shoal.kernels.cpu_kernels import CpuKernels

pytestmark = pytest.mark.usefixtures("kernels")


@pytest.fixture(autouse=True)
def bf16_dots(kernels: CpuKernels) -> None:
    if not torch.ops.shoal_cpu.bf16_panels_supported():
        pytest.skip("the bfloat16 panels need AVX512-BF16's dot products, which this CPU lacks")


def run(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    torch.ops.shoal_cpu.bf16_panel_linear(x, panels, bias, out)
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 over the bfloat16-rounded x and w: exact products, exact sums."""
    y = x.bfloat16().double() @ weight.bfloat16().double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize(("n", "k"), [(1, 2), (15, 4), (16, 30), (17, 576), (100, 64), (40, 1536)])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_product_of_the_rounded_inputs_in_float32(
    n: int, k: int, m: int, with_bias: bool
) -> None:
    """Only float32's summation of exact products stands between it and the exact sum: within
    k float32 roundings of the sum of |products| (oneDNN rounds each product to 8 bits)."""
    gen = torch.Generator().manual_seed(n * k + m)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = run(x, pack_bf16_panels(weight), n, bias)
    want = reference(x, weight, bias)
    scale = x.bfloat16().double().abs() @ weight.bfloat16().double().abs().T
    bound = scale * k * 2.0**-23 + (0.0 if bias is None else bias.abs().double() * 2.0**-23)
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rows_bits_are_its_own(threads: int) -> None:
    """A row alone, among 1 .. 40 others, at any thread count: the same bits (its own
    accumulator, K in order), so a step's size never moves a row's logits."""
    gen = torch.Generator().manual_seed(threads)
    weight, x = torch.randn(72, 96, generator=gen), torch.randn(40, 96, generator=gen)
    panels = pack_bf16_panels(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([run(x[i : i + 1], panels, 72) for i in range(40)])
        torch.set_num_threads(threads)
        for rows in (1, 3, 8, 9, 16, 17, 40):
            assert torch.equal(run(x[:rows], panels, 72), alone[:rows])
    finally:
        torch.set_num_threads(before)


def test_float32_rows_are_rounded_as_torch_rounds_them() -> None:
    """x in float32 gives the bits of x.to(torch.bfloat16) handed over: nearest even, ties, tiny
    and huge values, infinities (16 a pass, then a tail)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 70, generator=gen) * torch.logspace(-40, 38, 70)
    x[0, :4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 1e-45])
    x[1, :2] = torch.tensor([float("inf"), float("-inf")])
    x[2, :8] = torch.tensor([3.0e38, -3.0e38, 0.0, -0.0, 1e-39, 2.0**-133, 1.0 + 2.0**-9, 6.0])
    weight = torch.zeros(16, 70)
    for j in range(16):
        weight[j, j] = 1.0  # channel j reads x's column j alone
    weight[:, 60:] = 0.0
    panels = pack_bf16_panels(weight)
    narrow = x.to(torch.bfloat16)
    # an infinity times a zero weight is NaN in every channel: NaN against NaN is agreement
    same = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}
    torch.testing.assert_close(run(x, panels, 16), run(narrow, panels, 16), **same)
    finite = torch.isfinite(x).all(dim=1)
    normal = narrow[finite, :16].float()
    normal[normal.abs() < 2.0**-126] = 0.0  # the dot products take subnormals as zero
    torch.testing.assert_close(run(x[finite], panels, 16)[:, :16], normal, **same)
    strided = torch.zeros(5, 90, dtype=torch.bfloat16)[:, :70]  # rows 90 apart
    strided.copy_(narrow)
    torch.testing.assert_close(run(strided, panels, 16), run(narrow, panels, 16), **same)
    wide = torch.zeros(5, 90)[:, :70]
    wide.copy_(x)
    torch.testing.assert_close(run(wide, panels, 16), run(x, panels, 16), **same)


def test_the_panels_layout() -> None:
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)
    panels = pack_bf16_panels(weight)
    assert panels.shape == (2, 3, 2 * PANEL) and panels.dtype == torch.bfloat16
    for p in range(2):
        for i in range(3):
            for j in range(PANEL):
                channel = PANEL * p + j
                for h in range(2):
                    want = float(weight[channel, 2 * i + h]) if channel < 20 else 0.0
                    assert panels[p, i, 2 * j + h].item() == torch.tensor(want).bfloat16().item()


def test_refusals() -> None:
    panels = pack_bf16_panels(torch.ones(16, 8))
    x = torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="K must be even"):
        torch.ops.shoal_cpu.bf16_panel_linear(torch.ones(2, 7), panels, None, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.shoal_cpu.bf16_panel_linear(x, panels, None, torch.empty(2, 17))
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.shoal_cpu.bf16_panel_linear(x, panels.float(), None, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="out"):
        torch.ops.shoal_cpu.bf16_panel_linear(x, panels, None, torch.empty(3, 16))
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.shoal_cpu.bf16_panel_linear(x.double(), panels, None, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.shoal_cpu.bf16_panel_linear(x, panels, torch.ones(15), torch.empty(2, 16))
    empty = torch.empty(0, 16)
    torch.ops.shoal_cpu.bf16_panel_linear(torch.ones(0, 8), panels, None, empty)


def test_the_linear_on_panels_updates_and_heads() -> None:
    """`Bf16Linear` takes the panels where bf16_panels_available() says so (odd K: oneDNN's
    matmul); a weight update repacks; the head's top logits stay float32's."""
    from shoal.kernels.bf16_linear import bf16_panels_available

    if not bf16_panels_available():
        pytest.skip("this CPU has AMX: its bfloat16 linears take oneDNN's matmul on the tiles")
    gen = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    x = torch.randn(3, 2, 64, generator=gen)
    linear = Bf16Linear(weight, bias)
    assert linear.panels is not None and linear.weight is None and not linear.onednn
    assert torch.equal(linear(x), run(x.reshape(6, 64), linear.panels, 40, bias).view(3, 2, 40))
    other = torch.randn(40, 64, generator=gen)
    linear.load(other, None)
    assert torch.equal(linear(x).view(6, 40), run(x.reshape(6, 64), pack_bf16_panels(other), 40))
    assert Bf16Linear(torch.randn(8, 7, generator=gen), None).panels is None  # odd K
    head = Bf16Head(weight, None)
    logits = head(x.reshape(6, 64))
    top = logits.topk(4).indices
    exact = (x.reshape(6, 64) @ weight.T).gather(1, top)
    torch.testing.assert_close(logits.gather(1, top), exact, rtol=0, atol=1e-4)
