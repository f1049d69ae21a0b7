"""quantization="int8" (kernels/quant.py): the linear against float matmul, an engine on it
(generation, weight updates, sessions), its quality on SmolLM2, and the options it refuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bench_scripts import load_bench
from engines import EngineFactory
from weight_kinds import (
    check_a_weight_update_rebuilds,
    check_sessions_equal_stateless,
    flips_against,
    prompts,
)

from shoal.config import EngineOptions
from shoal.kernels.bf16_gated import GatedBf16Linear
from shoal.kernels.bf16_linear import Bf16Head, onednn_bf16_available
from shoal.kernels.cpu_features import CpuFeatures
from shoal.kernels.int8_gated import GatedInt8Linear
from shoal.kernels.int8_rows import (
    MANY_ROWS_BF16,
    MANY_ROWS_PANELS,
    MANY_ROWS_TILES,
    ManyRows,
    form_for,
    many_rows,
)
from shoal.kernels.linear import make_linear
from shoal.kernels.quant import (
    BLOCK,
    Int8Linear,
    Q4Blocks,
    Q8Blocks,
    exact_q4_blocks,
    q8_blocks,
)
from shoal.models.llama import LLAMA
from shoal.models.load import load_model
from shoal.models.weights import linear_weights
from shoal.resolve_options import resolve, resolve_linear

# Weights are int8 in blocks of 32 (relative step 1/127 of a block's largest weight) and
# activations int16 (1/32767), so a product is off by well under 1% of its size.
REL_TOL = 0.01
X_LEVELS = 32767  # the kernels' int16 activations
# The int8 kernel is one of the CPU kernels (conftest.py builds them once per environment).
pytestmark = pytest.mark.usefixtures("kernels")


def activation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far y may be from x w.T in float64 when x is rounded to int16 per block of 32: each
    x[k] moves by at most half its block's step (max |x| of the block / 32767), so y[n] moves
    by at most sum_k |w[n, k]| times that; twice it covers float32's own rounding."""
    m, k = x.shape
    padded = torch.zeros(m, -(-k // BLOCK) * BLOCK, dtype=torch.float64)
    padded[:, :k] = x.double().abs()
    half_step = padded.view(m, -1, BLOCK).amax(dim=2) / X_LEVELS / 2
    per_k = half_step.repeat_interleave(BLOCK, dim=1)[:, :k]
    return 2 * per_k @ weight.double().abs().T + 1e-6


def own_bound(linear: Int8Linear, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far the linear may be from x w.T in float64 on its own weights: the int16
    activations' bound, or from many_rows() rows on a CPU with bfloat16 dot products (quant.py:
    those steps run in bfloat16 through oneDNN) x, w and the product each rounded to 8 bits."""
    if x.shape[0] >= linear.many_rows and linear.tiles is not None:
        return 3 * 2**-8 * (x.double().abs() @ weight.double().abs().T) + 1e-5
    return activation_bound(x, weight)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


# ---- the linear ----------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 96), (33, 100), (8, 7), (3, 1536)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 17, MANY_ROWS_PANELS + 6])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float_matmul(n: int, k: int, m: int, with_bias: bool) -> None:
    """Ragged sizes: K of 100 and 7 end in a part block and a part vector, N of 33, 40 and 3 in
    a part panel of channels, M of 3, 5, 9 and 17 in tiles of rows of more than one size; 30
    rows reach the dequantized weights where a CPU has them (int8_rows.many_rows: float32 panels,
    bfloat16 with AMX or AVX512-BF16; an AVX-512 VNNI CPU without them runs the blocks at every
    size)."""
    gen = torch.Generator().manual_seed(n * k + m)
    weight = torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(m, k, generator=gen)
    linear = make_linear("int8", weight, bias)
    y = linear(x)
    assert y.shape == (m, n) and y.dtype == torch.float32 and linear.out_features == n
    assert rel_error(y, F.linear(x, weight, bias)) < REL_TOL
    # Against its own weights in float64, the kernel is off by its int16 activations only.
    own = linear.dequantized_weight()
    exact = F.linear(x.double(), own.double())
    exact = exact if bias is None else exact + bias.double()
    assert bool(((y.double() - exact).abs() <= own_bound(linear, x, own)).all())


@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 96), (3, 1536)])
@pytest.mark.parametrize("m", [1, 3, 5, 17, MANY_ROWS_PANELS])
def test_a_q4_1_weight_is_kept_as_it_came(n: int, k: int, m: int) -> None:
    """A weight dequantized from GGUF's Q4_1 (q * d + m, q in 0..15, d a float16; a block's
    minimum at q = 0 and maximum at 15, as GGUF's quantizer puts them) is stored as Q4 blocks
    and given back to the bit; the 4-bit kernel multiplies by exactly it."""
    weight = q4_1_weight(n, k, seed=n + k)
    linear = Int8Linear(weight, None)
    assert isinstance(linear.blocks, Q4Blocks)
    assert torch.equal(linear.dequantized_weight(), weight)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    exact = F.linear(x.double(), weight.double())
    assert bool(((linear(x).double() - exact).abs() <= own_bound(linear, x, weight)).all())


def test_a_weight_q4_cannot_give_back_is_stored_as_q8() -> None:
    weight = q4_1_weight(8, 64, seed=0)
    assert exact_q4_blocks(weight) is not None
    weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(1.0))  # one value off by an ulp
    assert exact_q4_blocks(weight) is None
    assert isinstance(Int8Linear(weight, None).blocks, Q8Blocks)
    assert exact_q4_blocks(torch.randn(8, 100)) is None  # K not in whole blocks


def q4_1_weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # GGUF's quantizer puts a block's min at 0 and its max at 15
    scale = (torch.rand(n, k // BLOCK, 1, generator=gen) * 0.02).half().float()
    low = -torch.rand(n, k // BLOCK, 1, generator=gen) * 0.1
    return (q * scale + low).view(n, k)


def test_each_block_is_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 100, generator=gen)
    weight[3, 40:50] *= 100  # one block with a large weight: only its own step grows
    blocks = q8_blocks(weight)
    # in panels of 16 channels: [P, B, 16 pairs x 16 channels x 2], scales [P, B, 16]
    assert blocks.q.dtype == torch.int8 and blocks.q.shape == (4, 4, 512)
    assert blocks.d.shape == (4, 4, 16)
    values = blocks.values()
    assert values.shape == (64, 128)
    assert int(values.abs().max()) == 127 and not bool(values[:, 100:].any())
    error = (blocks.dequantize() - weight).abs()
    d = blocks.d.permute(0, 2, 1).reshape(64, 4)
    half_step = d[:, torch.arange(100) // BLOCK] / 2
    assert bool((error <= half_step * (1 + 1e-6)).all())
    assert float(half_step[3, 0]) < float(half_step[3, 40]) / 20


def test_rows_are_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    linear = Int8Linear(torch.randn(32, 64, generator=gen), None)
    x = torch.randn(9, 64, generator=gen)
    x[4] *= 1000
    torch.testing.assert_close(linear(x)[2:3], linear(x[2:3]), rtol=1e-5, atol=1e-5)


def test_shapes_zero_rows_and_empty_batches() -> None:
    weight = torch.randn(24, 64)
    weight[5] = 0
    bias = torch.randn(24)
    linear = Int8Linear(weight, bias)
    x = torch.randn(2, 3, 64)
    x[1, 2] = 0
    y = linear(x)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y[1, 2], bias)
    torch.testing.assert_close(y[..., 5], bias[5].expand(2, 3))
    assert linear(torch.randn(0, 64)).shape == (0, 24)
    assert linear(torch.randn(4, 128)[:, ::2]).shape == (4, 24)  # strided rows are copied


def test_load_takes_the_new_weight() -> None:
    gen = torch.Generator().manual_seed(3)
    old_w, new_w = torch.randn(48, 64, generator=gen), torch.randn(48, 64, generator=gen)
    old_b, new_b = torch.randn(48, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    linear = Int8Linear(old_w, old_b)
    before = linear(x)
    linear.load(new_w, new_b)
    assert rel_error(linear(x), F.linear(x, new_w, new_b)) < REL_TOL
    assert rel_error(before, F.linear(x, new_w, new_b)) > 0.5
    torch.testing.assert_close(linear(x), Int8Linear(new_w, new_b)(x), rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 5, 9, MANY_ROWS_TILES, MANY_ROWS_PANELS, 33])
@pytest.mark.parametrize("q4", [True, False])
def test_a_gated_gate_up_gives_the_plain_ones_bits(m: int, q4: bool) -> None:
    """A SiLU-gated gate_up's `silu_mul` is the plain linear's product then silu_mul, bit for
    bit, below many_rows() (the blocks) and from it on (the gated float32 panels, or the gated
    bfloat16 panels where the many rows multiply in bfloat16 panels: the act then rounded to
    bfloat16, as the down's call rounds it); a call is the product; a weight update takes the
    new weight."""
    inter, k = 20, 64
    old = q4_1_weight(2 * inter, k, seed=m) if q4 else torch.randn(2 * inter, k) * 0.1
    new = old.flip(0)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    gated = make_linear("int8", old.clone(), None, gated=True)
    assert isinstance(gated, GatedInt8Linear)
    assert isinstance(make_linear("int8", old, torch.zeros(2 * inter), gated=True), Int8Linear)
    for weight in (old, new):
        gated.load(weight.clone(), None)
        plain = Int8Linear(weight.clone(), None)
        assert type(gated.blocks) is type(plain.blocks) is (Q4Blocks if q4 else Q8Blocks)
        product = plain(x)
        expected = torch.empty(m, inter)
        torch.ops.shoal_cpu.silu_mul(product, expected)
        act = gated.silu_mul(x)
        if act.dtype == torch.bfloat16:
            assert isinstance(gated.tiles, GatedBf16Linear) and gated.takes_many(m)
            expected = expected.to(torch.bfloat16)
        assert torch.equal(act, expected)
        assert torch.equal(gated(x), product)


ZEN5 = CpuFeatures("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}))


@pytest.mark.skipif(not onednn_bf16_available(), reason="oneDNN has no bfloat16 matmul on this CPU")
def test_the_head_takes_the_bfloat16_form_from_many_rows_too() -> None:
    """On a CPU with AVX512-BF16 and no AMX the lm_head, like the layers, multiplies its
    dequantized weights in bfloat16 from many_rows() rows on (a Bf16Head: each row's top
    candidates again in float32, so the greedy choice is its own weights'), and in its blocks
    below."""
    form = form_for(ZEN5, onednn_bf16=True, vnni_build=True)
    assert form == ManyRows(MANY_ROWS_BF16, True)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(700, 64, generator=gen) * 0.1
    head = Int8Linear(weight, None, head=True, form=form)
    assert isinstance(head.tiles, Bf16Head) and head.many_rows == MANY_ROWS_BF16
    own = head.dequantized_weight().double()
    x = torch.randn(MANY_ROWS_BF16 + 3, 64, generator=gen)
    y, exact = head(x), x.double() @ own.T
    torch.testing.assert_close(y.amax(-1).double(), exact.amax(-1), rtol=0, atol=1e-5)
    assert torch.equal(y.argmax(-1), exact.argmax(-1))
    few = x[: MANY_ROWS_BF16 - 1]
    blocks = torch.empty(few.shape[0], 700)
    head.blocks.run(few, None, blocks)
    assert torch.equal(head(few), blocks)


def test_the_kernels_refuse_what_they_cannot_read() -> None:
    eight = q8_blocks(torch.randn(8, 64))
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    q8 = torch.ops.shoal_cpu.q8_linear
    with pytest.raises(RuntimeError, match="q must be"):
        q8(torch.randn(2, 65), eight.q, eight.d, None, out)
    with pytest.raises(RuntimeError, match="d must be"):
        q8(x, eight.q, eight.d[:, :1].contiguous(), None, out)
    with pytest.raises(RuntimeError, match="bias must be"):
        q8(x, eight.q, eight.d, torch.randn(7), out)
    with pytest.raises(RuntimeError, match="out must be"):
        q8(x, eight.q, eight.d, None, torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="q must be"):
        q8(x, eight.q.float(), eight.d, None, out)
    with pytest.raises(RuntimeError, match="x must be"):
        q8(torch.randn(64, 2).t(), eight.q, eight.d, None, out)
    four = exact_q4_blocks(q4_1_weight(8, 64, seed=1))
    assert four is not None
    q4 = torch.ops.shoal_cpu.q4_linear
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        q4(torch.randn(2, 48), four.q, four.d, four.m, None, out)
    with pytest.raises(RuntimeError, match="m must be"):
        q4(x, four.q, four.d, four.m.double(), None, out)
    with pytest.raises(RuntimeError, match="q must be"):
        q4(x, four.q.to(torch.int8), four.d, four.m, None, out)
    with pytest.raises(RuntimeError, match="q must be"):  # 17 channels: two panels
        q4(x, four.q, four.d, four.m, None, torch.empty(2, 17))


# ---- an engine on it -----------------------------------------------------------------------


async def test_an_int8_engine_follows_the_float_engine(make_engine: EngineFactory) -> None:
    """int8 picks float32's tokens until a near-tie, where it may pick the runner-up. Measured
    on `prompts(8, 0)`, 12 tokens each: three of eight flip, at float32 margins of 0.007, 0.041
    and 0.113. The first (prompt 1, 19 tokens) is its first token: 253 at logit 5.1670 against 6
    at 5.1601 in transformers; int8 picks 6, as transformers does on the same int8 weights."""
    batch = prompts(8, 0)
    quantized = await make_engine(quantization="int8", page_size=4)
    assert quantized.resolved.linear_kind == "int8"
    float32 = await make_engine(page_size=4)
    assert await flips_against(quantized, float32, batch) <= len(batch) // 2


async def test_a_weight_update_requantizes(
    make_engine: EngineFactory, other_folder: Path, tiny_folder: Path
) -> None:
    await check_a_weight_update_rebuilds(
        make_engine, other_folder, tiny_folder, quantization="int8"
    )


async def test_sessions_on_int8_equal_stateless_requests(make_engine: EngineFactory) -> None:
    await check_sessions_equal_stateless(make_engine, quantization="int8")


# ---- options it refuses --------------------------------------------------------------------


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be int8 or unset, got 'int4'"):
        resolve(EngineOptions(quantization="int4"), model_context=2048)


def test_int8_is_cpu_only() -> None:
    options = EngineOptions(quantization="int8")
    with pytest.raises(ValueError, match="int8 runs on the CPU only"):
        resolve_linear(options, torch.device("cuda"), torch.bfloat16)
    assert resolve_linear(options, torch.device("cpu"), torch.float32) == "int8"
    assert resolve_linear(EngineOptions(), torch.device("cpu"), torch.float32) == "packed"


def test_the_linear_refuses_other_devices() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        Int8Linear(torch.randn(4, 4, device="meta"), None)


# ---- quality on the real model --------------------------------------------------------------


@pytest.fixture
def one_thread() -> Iterator[None]:
    """On a busy two-core machine two OpenMP threads stall at every barrier (115 s against 33 s
    with one, at load 3.5); results agree to the position."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_smollm2_int8_keeps_the_gguf_weights() -> None:
    """The bundled GGUF holds the projections as Q4_1 and the embedding (the tied lm_head) as
    Q8_0: int8 keeps every one of them to the bit, the projections as 4-bit blocks."""
    loaded = load_model(None, progress=False)
    model = LLAMA.build(loaded.config, loaded.weights, torch.float32, torch.device("cpu"), "int8")
    linears = model.weights.linears()
    originals = linear_weights(LLAMA.source(loaded.config, loaded.weights))
    for linear, (weight, _) in zip(linears, originals, strict=True):
        assert isinstance(linear, Int8Linear)
        assert torch.equal(linear.dequantized_weight(), weight.float())
    kinds = [type(linear.blocks) for linear in linears if isinstance(linear, Int8Linear)]
    assert kinds == [Q8Blocks] + [Q4Blocks] * (len(linears) - 1)


@pytest.mark.slow
@pytest.mark.skipif(
    not many_rows().bf16,
    reason="many-row steps run in bfloat16 only with AMX or AVX512-BF16",
)
def test_smollm2_int8_quality_on_the_tiles(
    monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """The same on a CPU with bfloat16 dot products, fed chunks of 64 tokens, so that the
    dequantized weights multiply in bfloat16 (quant.py), the lm_head's top logits again in float32:
    int8's bounds hold (the whole text at chunks of 512: bench/README.md)."""
    quality = load_bench("quality", monkeypatch)
    loaded = load_model(None, progress=False)
    ids = quality.text_ids(loaded, 1024)
    line = quality.compare(loaded, "int8", "packed", ids, window=1024, chunk=64)
    assert line["top1_agreement"] >= quality.MIN_AGREEMENT, line
    assert abs(line["ppl_ratio"] - 1) <= quality.PPL_TOLERANCE, line


@pytest.mark.slow
def test_smollm2_int8_quality(monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """bench/quality.py on the text's first 1,536 tokens (1,534 predictions; ~25-35 s): top-1
    agreement with float32 >= 97% and perplexity within 3%, the KV as the engine's auto picks it
    (below). The weights are float32's own (above), only the activations are rounded to 15
    bits: fed fewer than 10 tokens a forward, so the block kernels run, as in a decode. The
    whole text measured 99.96% and +0.00% (bench/README.md)."""
    quality = load_bench("quality", monkeypatch)
    loaded = load_model(None, progress=False)
    ids = quality.text_ids(loaded, 1536)
    chunk = MANY_ROWS_TILES - 1
    line = quality.compare(loaded, "int8", "packed", ids, window=1024, chunk=chunk)
    assert line["predictions"] == 1534
    assert line["top1_agreement"] >= quality.MIN_AGREEMENT, line
    assert abs(line["ppl_ratio"] - 1) <= quality.PPL_TOLERANCE, line
    assert line["verdict"] == "pass"


@pytest.mark.slow
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_smollm2_int8_quality_with_either_kv(
    monkeypatch: pytest.MonkeyPatch, one_thread: None, kv: torch.dtype
) -> None:
    """int8's KV is bfloat16 by default where the CPU takes bfloat16 weights by default
    (resolve_options.resolve_kv_dtype), float32 elsewhere; either holds int8's bounds, on any
    CPU, a token at a time through the compiled decode kernel as a decode step reads it (the
    whole text with a bfloat16 KV: 99.89% top-1, perplexity -0.04%, bench/README.md)."""
    quality = load_bench("quality", monkeypatch)
    loaded = load_model(None, progress=False)
    ids = quality.text_ids(loaded, 256)
    line = quality.compare(loaded, "int8", "packed", ids, 256, 1, kv_dtype=kv, attention="cpu")
    assert line["kv"] == str(kv).removeprefix("torch.")
    assert line["top1_agreement"] >= quality.MIN_AGREEMENT, line
    assert abs(line["ppl_ratio"] - 1) <= quality.PPL_TOLERANCE, line
