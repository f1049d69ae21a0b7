"""The compiled CPU kernels (kernels/csrc/) against the torch reference: decode attention (also
in sliding windows and soft-capped, against dense_attention.py's dense attention) and
its refusals of bad indices, RMSNorm, the fused residual add, RoPE; how the engine picks them or
falls back."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from dense_attention import dense_outputs, poison_before_windows

from shoal.api.engine import Engine
from shoal.api.startup import cpu_kernels
from shoal.config import EngineOptions
from shoal.kernels import cpu_kernels as cpu_kernels_module
from shoal.kernels.attention import TorchAttention, store_kv
from shoal.kernels.batch import BatchShape
from shoal.kernels.cpu_kernels import CpuKernels, DecodeKernel, KernelUnavailable
from shoal.kernels.elementwise import CompiledElementwise, TorchElementwise
from shoal.kernels.kernel_views import KernelDecodes
from shoal.kernels.linear import (
    GatedPanels,
    PackedLinear,
    make_linear,
    pack_gated_panels,
    pack_panels,
)
from shoal.kernels.rope import cos_sin_table, inv_frequencies
from shoal.models.load import LoadedModel
from shoal.params import SamplingParams
from shoal.resolve_options import Resolved, resolve


@pytest.fixture(scope="module")
def kernel(kernels: CpuKernels) -> DecodeKernel:
    return kernels.paged_decode


class Step(NamedTuple):
    page_table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    shape: BatchShape
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor


def random_step(
    gen: torch.Generator, prefix_lens: list[int], extend_lens: list[int], heads: int,
    kv_heads: int, dim: int, page: int,
) -> Step:  # fmt: skip
    max_pages = max(-(-(p + n) // page) for p, n in zip(prefix_lens, extend_lens, strict=True))
    num_pages = max(1200, len(prefix_lens) * max_pages)
    k_cache = torch.randn(num_pages * page, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_pages * page, kv_heads, dim, generator=gen)
    page_ids = torch.randperm(num_pages, generator=gen)[: len(prefix_lens) * max_pages]
    page_table = page_ids.view(len(prefix_lens), max_pages)
    shape = BatchShape(tuple(range(len(prefix_lens))), tuple(prefix_lens), tuple(extend_lens))
    total = sum(extend_lens)
    # q as the model hands it over: a view of the rotated [T, H + Hkv, D] tensor.
    q = torch.randn(total, heads + kv_heads, dim, generator=gen)[:, :heads]
    k_new = torch.randn(total, kv_heads, dim, generator=gen)
    v_new = torch.randn(total, kv_heads, dim, generator=gen)
    return Step(page_table, k_cache, v_cache, shape, q, k_new, v_new)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [(9, 3, 64, 16), (6, 2, 8, 4), (4, 4, 20, 8), (8, 1, 128, 16), (16, 2, 64, 16)],
)
def test_kernel_equals_the_reference(
    kernel: DecodeKernel, heads: int, kv_heads: int, dim: int, page: int
) -> None:
    """Decodes of lengths 1..300 (several of the reference's length groups), beside a prefill
    chunk with a cached prefix and a fresh prompt that the kernel must leave alone. Heads of 64
    and 128 take the AVX-512 build's four-key products and register-held sums (a KV head's 8
    query heads in chunks of 6 and 2 at 64, of 2 at 128); 8 and 20 the one-key loops."""
    gen = torch.Generator().manual_seed(heads * dim + page)
    prefix_lens = [0, 150, 7, 0, 9, 299, 1, 40, 63]
    extend_lens = [1, 1, 1, 5, 4, 1, 1, 1, 1]
    table, k_cache, v_cache, shape, q, k_new, v_new = random_step(
        gen, prefix_lens, extend_lens, heads, kv_heads, dim, page
    )
    reference = TorchAttention(page).prepare(table, shape)
    fused = TorchAttention(page, kernel).prepare(table, shape)
    assert fused.kernel_decodes is not None and not fused.decodes and len(reference.decodes) > 1
    reference.store(k_cache, v_cache, k_new, v_new)
    expected = reference.attend(q, k_cache, v_cache, dim**-0.5)
    got = fused.attend(q, k_cache, v_cache, dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 7, 41, 300, 4096])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "page"), [(9, 3, 64, 16), (6, 2, 20, 1)])
def test_kernel_in_a_window_and_soft_capped_equals_dense_attention(
    kernel: DecodeKernel, heads: int, kv_heads: int, dim: int, page: int, window: int,
    softcap: float | None,
) -> None:  # fmt: skip
    """Windows of 1 key, shorter than most decodes, as long as one (41) and as the longest
    (300), longer than all; the step's chunks go through the reference beside the kernel."""
    gen = torch.Generator().manual_seed(window + page)
    prefix_lens = [0, 150, 7, 0, 9, 299, 1, 40, 63]
    extend_lens = [1, 1, 1, 5, 4, 1, 1, 1, 1]
    table, k_cache, v_cache, shape, q, k_new, v_new = random_step(
        gen, prefix_lens, extend_lens, heads, kv_heads, dim, page
    )
    fused = TorchAttention(page, kernel).prepare(table, shape)
    fused.store(k_cache, v_cache, k_new, v_new)
    got = fused.attend(q, k_cache, v_cache, dim**-0.5, window=window, softcap=softcap)
    expected = dense_outputs(q, k_cache, v_cache, table, shape, page, dim**-0.5, window, softcap)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def stored_decodes(
    kernel: DecodeKernel, step: Step, page: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, KernelDecodes]:
    """The step's caches in `dtype` with its new tokens stored, and its decodes as the kernel
    takes them."""
    k_cache, v_cache = step.k_cache.to(dtype), step.v_cache.to(dtype)
    meta = TorchAttention(page, kernel).prepare(step.page_table, step.shape)
    meta.store(k_cache, v_cache, step.k_new, step.v_new)
    fused = meta.kernel_decodes
    assert fused is not None
    return k_cache, v_cache, fused


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"), [(9, 3, 64, 16), (8, 1, 128, 16), (6, 2, 20, 1)]
)
def test_a_decode_gives_each_head_its_bits_however_the_threads_share_it(
    kernel: DecodeKernel, heads: int, kv_heads: int, dim: int, page: int,
    dtype: torch.dtype, window: int,
) -> None:  # fmt: skip
    """A work item is a whole sequence where there are enough to share out, one KV head of one
    where there are not; each head's arithmetic is the same either way: 1, 2 and 3 threads over
    1 and 2 sequences give the same bits, and the reference's values. Heads of 64 and 128 take
    the four-key products and the register-held sums, 20 the one-key loops."""
    gen = torch.Generator().manual_seed(heads + dim + window)
    step = random_step(gen, [150, 40], [1, 1], heads, kv_heads, dim, page)
    k_cache, v_cache, fused = stored_decodes(kernel, step, page, dtype)
    before = torch.get_num_threads()
    try:
        for softcap in (0.0, 5.0):
            outs = []
            for threads, rows in itertools.product((1, 2, 3), (1, 2)):
                torch.set_num_threads(threads)
                out = torch.zeros(step.q.shape)
                kernel(step.q, k_cache, v_cache, fused.page_ids[:rows], fused.seq_lens[:rows],
                       fused.token_index[:rows], page, dim**-0.5, out, window, softcap)  # fmt: skip
                outs.append(out[0])
            assert all(torch.equal(out, outs[0]) for out in outs[1:]), softcap
            expected = dense_outputs(step.q, k_cache.float(), v_cache.float(), step.page_table,
                                     step.shape, page, dim**-0.5, window or None,
                                     softcap or None)  # fmt: skip
            torch.testing.assert_close(outs[0].double(), expected[0], rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[300, 3, 5, 200, 1, 1, 1, 1, 64], [1, 1, 1, 1, 1, 400]])
def test_threads_share_sequences_by_their_keys_and_every_one_is_attended(
    kernel: DecodeKernel, lens: list[int], dtype: torch.dtype
) -> None:
    """Sequences of 1 to 400 keys, shared out by their keys (balanced_split.h), not by count:
    every row attended (the output starts NaN), the same bits at 1, 2 and 3 threads, and the
    reference's values."""
    heads, kv_heads, dim, page = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(len(lens))
    step = random_step(gen, lens, [1] * len(lens), heads, kv_heads, dim, page)
    k_cache, v_cache, fused = stored_decodes(kernel, step, page, dtype)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.full(step.q.shape, float("nan"))
            kernel(step.q, k_cache, v_cache, fused.page_ids, fused.seq_lens, fused.token_index,
                   page, dim**-0.5, out, 0, 0.0)  # fmt: skip
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert bool(torch.isfinite(outs[0]).all())
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    expected = dense_outputs(step.q, k_cache.float(), v_cache.float(), step.page_table,
                             step.shape, page, dim**-0.5, None, None)  # fmt: skip
    for row, want in enumerate(expected):
        torch.testing.assert_close(outs[0][row].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("garbage", [1e4, float("nan")])
def test_kernel_never_reads_before_the_window(kernel: DecodeKernel, garbage: float) -> None:
    """Pages wholly before each decode's window hold garbage (even NaN) or are not pages at
    all (an id out of range): the kernel neither reads nor checks them."""
    gen = torch.Generator().manual_seed(2)
    window, page, dim = 24, 4, 16
    step = random_step(gen, [3, 50, 23, 24, 97], [1] * 5, 6, 2, dim, page)
    meta = TorchAttention(page, kernel).prepare(step.page_table, step.shape)
    meta.store(step.k_cache, step.v_cache, step.k_new, step.v_new)
    expected = dense_outputs(step.q, step.k_cache, step.v_cache, step.page_table, step.shape,
                             page, dim**-0.5, window, 5.0)  # fmt: skip
    assert poison_before_windows(step.k_cache, step.v_cache, step.page_table, step.shape, page,
                                 window, garbage) > 0  # fmt: skip
    got = meta.attend(step.q, step.k_cache, step.v_cache, dim**-0.5, window=window, softcap=5.0)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    fused = meta.kernel_decodes
    assert fused is not None
    page_ids = fused.page_ids.clone()
    for b, seq_len in enumerate(fused.seq_lens.tolist()):
        page_ids[b, : max(0, seq_len - window) // page] = 10**9
    out = torch.empty(step.q.shape)
    kernel(step.q, step.k_cache, step.v_cache, page_ids, fused.seq_lens, fused.token_index, page,
           dim**-0.5, out, window, 5.0)  # fmt: skip
    assert torch.equal(out, got)
    with pytest.raises(RuntimeError, match="page id out of range"):  # without the window: read
        kernel(step.q, step.k_cache, step.v_cache, page_ids, fused.seq_lens, fused.token_index,
               page, dim**-0.5, out)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_store_writes_what_index_copy_writes(
    kernels: CpuKernels, dtype: torch.dtype
) -> None:
    """Every new token's K and V into its slot, from views of a wider tensor as the model's
    fused qkv output gives them; a slot given twice keeps the later token, as index_copy_. A
    bfloat16 cache (`kv_cache_dtype`) gets float32 rounded to nearest even, as torch's `.to`."""
    gen = torch.Generator().manual_seed(4)
    kv_heads, dim, slots = 3, 8, 40
    qkv = torch.randn(6, (4 + 2 * kv_heads) * dim, generator=gen)
    k = qkv[:, 4 * dim : (4 + kv_heads) * dim].view(6, kv_heads, dim)
    v = qkv[:, (4 + kv_heads) * dim :].view(6, kv_heads, dim)
    slot_mapping = torch.tensor([3, 17, 39, 0, 17, 5])
    caches = [torch.randn(slots, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv(expected[0], expected[1], slot_mapping, k, v)
    kernels.store_kv(caches[0], caches[1], slot_mapping, k, v)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    assert torch.equal(caches[0][39], k[2].to(dtype))  # bfloat16: rounded, not truncated
    with pytest.raises(RuntimeError, match="both float32 or bfloat16"):
        kernels.store_kv(caches[0], caches[1].double(), slot_mapping, k, v)
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.store_kv(caches[0], caches[1], torch.tensor([1, 2, 3, 4, 5, slots]), k, v)
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])  # none written
    with pytest.raises(RuntimeError, match="dense"):
        kernels.store_kv(caches[0], caches[1], slot_mapping, k.transpose(1, 2), v)


def test_bad_indices_are_refused_before_any_read(kernel: DecodeKernel) -> None:
    gen = torch.Generator().manual_seed(1)
    step = random_step(gen, [5, 20], [1, 1], 6, 2, 8, 4)
    q, k_cache, v_cache = step.q, step.k_cache, step.v_cache
    meta = TorchAttention(4, kernel).prepare(step.page_table, step.shape)
    fused = meta.kernel_decodes
    assert fused is not None
    out = torch.empty(q.shape)
    cases = {
        "page id out of range": (fused.page_ids + 10_000, fused.seq_lens, fused.token_index),
        "length out of range": (fused.page_ids, fused.seq_lens + 1_000, fused.token_index),
        "token index out of range": (fused.page_ids, fused.seq_lens, fused.token_index + 7),
    }
    for message, (pages, lens, tokens) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            kernel(q, k_cache, v_cache, pages, lens, tokens, 4, 0.5, out)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, k_cache, v_cache, fused.page_ids.int(), fused.seq_lens, fused.token_index, 4,
               0.5, out)  # fmt: skip


def test_a_failed_build_falls_back_under_auto_and_fails_when_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    def no_compiler(cache_dir: Path, cancel: object = None) -> CpuKernels:
        raise KernelUnavailable("the CPU kernels could not be built: no compiler")

    def resolved(attention: str, quantization: str | None = None) -> Resolved:
        options = EngineOptions(device="cpu", attention=attention, quantization=quantization)
        return resolve(options, 2048)

    monkeypatch.setattr("shoal.api.startup.load_cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING, logger="shoal"):
        assert cpu_kernels(resolved("auto"), tmp_path, asked_attention="auto") is None
    assert "no compiler" in caplog.text
    with pytest.raises(ValueError, match=r"attention cpu: .*no compiler"):
        cpu_kernels(resolved("cpu"), tmp_path, asked_attention="cpu")
    assert cpu_kernels(resolved("torch"), tmp_path, asked_attention="torch") is None  # none asked
    with pytest.raises(ValueError, match=r"quantization int8: .*no compiler"):
        cpu_kernels(resolved("torch", "int8"), tmp_path, asked_attention="torch")


def test_the_build_names_the_cpu_capability() -> None:
    assert cpu_kernels_module.capability() in cpu_kernels_module.CAPABILITY_FLAGS
    for source in cpu_kernels_module.SOURCES:
        assert source.is_file()  # shipped with the package (package-data)


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: more than one thread's share
def test_elementwise_ops_equal_the_reference(kernels: CpuKernels, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    compiled, reference = CompiledElementwise(kernels), TorchElementwise()
    hidden, heads, dim = 576, 12, 64
    x = torch.randn(rows, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    # RMSNorm sums the squares in another order: equal within the last bits.
    torch.testing.assert_close(
        compiled.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5),
        rtol=2e-6, atol=1e-6,
    )  # fmt: skip
    delta = torch.randn(rows, hidden, generator=gen)
    h_ref, norm_ref = reference.add_rms_norm(x, delta, weight, 1e-5)
    h, norm = compiled.add_rms_norm(x.clone(), delta, weight, 1e-5)
    assert torch.equal(h, h_ref)  # the residual add: one rounding, bit-equal
    torch.testing.assert_close(norm, norm_ref, rtol=2e-6, atol=1e-6)
    # RoPE: separate multiplies and an add, as Hugging Face's formula: bit-equal. On a view
    # of a wider tensor, as the model rotates the q and k part of its fused qkv output.
    cos, sin = cos_sin_table(inv_frequencies(dim, 10000.0, None), 4096)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    qkv = torch.randn(rows, (heads + 4) * dim, generator=gen)
    qk = qkv[:, : heads * dim].view(rows, heads, dim)
    expected = reference.rope(qk.clone(), cos[positions], sin[positions])
    assert torch.equal(compiled.rope(qk, cos[positions], sin[positions]), expected)
    assert torch.equal(qkv[:, : heads * dim].view(rows, heads, dim), expected)  # in place
    # SiLU-and-multiply: torch's formula on the same vector exp, bit-equal; 100 wide ends in
    # a part vector, done in scalars by both.
    for inter in (1536, 100):
        gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
        assert torch.equal(compiled.silu_mul(gate_up), reference.silu_mul(gate_up))


def test_elementwise_ops_refuse_what_they_cannot_read(kernels: CpuKernels) -> None:
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(x, torch.ones(32), 1e-5, torch.empty(4, 64))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rms_norm(x.double(), torch.ones(64), 1e-5, torch.empty(4, 64))
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernels.rope(torch.randn(4, 2, 64), torch.ones(3, 64), torch.ones(3, 64))
    with pytest.raises(RuntimeError, match=r"gate_up must be \[T, 2I\]"):
        kernels.silu_mul(torch.randn(4, 63), torch.empty(4, 32))


async def test_the_engine_decodes_with_the_kernel_as_with_the_reference(
    tiny_model: LoadedModel,
) -> None:
    """Greedy tokens of a few prompts, the compiled kernels against the torch reference, in
    one engine each, in float32; their sums differ from torch's only in the last bits. (A
    bfloat16 KV's: tests/kernels/test_kv_bf16.py.)"""
    prompts = [[5, 6, 7], list(range(10, 60)), [3] * 17]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    results = {}
    for attention in ("cpu", "torch"):
        async with Engine(tiny_model, attention=attention, dtype="float32") as engine:
            assert engine.attention == attention
            outs = [await engine.generate(input_ids=p, sampling=params).result() for p in prompts]
            results[attention] = [o.token_ids for o in outs]
    assert results["cpu"] == results["torch"]


@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 100), (8, 7), (5, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 40])
def test_f32_linear_equals_float64(kernels: CpuKernels, n: int, k: int, rows: int) -> None:
    """Ragged sizes: a last panel part empty, row tiles of 6 and what is left, odd K. Each
    output is one chain of k multiply-adds, so its error is within the chain's bound:
    k units of rounding (2^-24) of the sum of |x w| (plus one for the bias)."""
    gen = torch.Generator().manual_seed(n + k + rows)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    for bias in (None, torch.randn(n, generator=gen)):
        out = torch.empty(rows, n)
        kernels.f32_linear(x, pack_panels(weight), bias, out)
        exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        magnitude = F.linear(x.double().abs(), weight.double().abs())
        if bias is not None:
            magnitude = magnitude + bias.double().abs()
        bound = (k + 1) * 2.0**-24 * magnitude
        assert bool(((out.double() - exact).abs() <= bound).all())
        torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("rows", "k"), [(383, 64), (384, 64), (1000, 576), (700, 1536)])
def test_f32_linear_rows_in_blocks_give_each_row_its_own_bits(
    kernels: CpuKernels, rows: int, k: int
) -> None:
    """From 384 rows a thread takes the rows in blocks (panels.h); every row still comes out
    exactly as that row alone does, the last block's ragged tail included."""
    gen = torch.Generator().manual_seed(rows + k)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(40, k, generator=gen)
    bias = torch.randn(40, generator=gen)
    panels = pack_panels(weight)
    out = torch.full((rows, 40), float("nan"))
    kernels.f32_linear(x, panels, bias, out)
    for row in (0, 1, 55, 56, rows // 2, rows - 2, rows - 1):
        alone = torch.empty(1, 40)
        kernels.f32_linear(x[row : row + 1], panels, bias, alone)
        assert torch.equal(out[row], alone[0]), row
    assert not out.isnan().any()


def test_f32_linear_refuses_what_it_cannot_read(kernels: CpuKernels) -> None:
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    panels = pack_panels(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="panels must be"):
        kernels.f32_linear(x, panels.double(), None, out)
    with pytest.raises(RuntimeError, match="panels must be"):
        kernels.f32_linear(torch.randn(2, 63), panels, None, out)
    with pytest.raises(RuntimeError, match="panels must be"):
        kernels.f32_linear(x, panels, None, torch.empty(2, 17))  # two panels' worth of channels
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.f32_linear(torch.randn(64, 2).t(), panels, None, out)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.f32_linear(x, panels, torch.randn(9), out)
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.f32_linear(x, panels, None, torch.empty(3, 8))


def test_a_packed_linear_runs_the_panels_and_takes_updates(kernels: CpuKernels) -> None:
    """With the kernels loaded the weight is kept in panels only; a load packs the new one."""
    gen = torch.Generator().manual_seed(7)
    old, new = torch.randn(48, 64, generator=gen), torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    linear = PackedLinear(old.clone(), bias.clone())
    assert linear.panels is not None and linear.packed is None
    for rows in (1, 6, 7, 33):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(linear(x), F.linear(x, old, bias), rtol=1e-5, atol=1e-5)
        linear.load(new.clone(), bias.clone())
        torch.testing.assert_close(linear(x), F.linear(x, new, bias), rtol=1e-5, atol=1e-5)
        linear.load(old.clone(), bias.clone())


@pytest.mark.parametrize(("inter", "k"), [(1536, 576), (20, 64), (8, 7), (40, 100)])
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 400])
def test_gated_panels_give_the_bits_of_the_product_then_silu_mul(
    kernels: CpuKernels, inter: int, k: int, rows: int
) -> None:
    """f32_silu_mul over gated panels is f32_linear and then silu_mul, bit for bit: every
    channel, an intermediate size that is not a multiple of 8 (its last panel part empty,
    its last channels past silu_mul's last whole vector), rows in blocks (400)."""
    gen = torch.Generator().manual_seed(inter + k + rows)
    x, gate_up = torch.randn(rows, k, generator=gen), torch.randn(2 * inter, k, generator=gen)
    product = torch.empty(rows, 2 * inter)
    kernels.f32_linear(x, pack_panels(gate_up), None, product)
    expected = torch.empty(rows, inter)
    kernels.silu_mul(product, expected)
    fused = torch.full((rows, inter), float("nan"))
    kernels.f32_silu_mul(x, pack_gated_panels(gate_up), fused)
    assert torch.equal(fused, expected)
    gated = GatedPanels(gate_up.clone(), None)
    assert torch.equal(gated.silu_mul(x), expected)
    assert torch.equal(gated(x), product)  # a call is the product, in the usual order


def test_gated_panels_take_updates_and_refuse_what_they_cannot_read(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(3)
    old, new = torch.randn(48, 64, generator=gen), torch.randn(48, 64, generator=gen)
    x = torch.randn(7, 64, generator=gen)
    gated = GatedPanels(old.clone(), None)
    before = gated.silu_mul(x)
    gated.load(new.clone(), None)
    gate, up = F.linear(x, new).chunk(2, dim=-1)
    torch.testing.assert_close(gated.silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(gated.silu_mul(x), before)
    panels = pack_gated_panels(old)  # 24 channels: 3 panels
    with pytest.raises(RuntimeError, match="f32_silu_mul"):
        kernels.f32_silu_mul(x, panels, torch.empty(7, 16))  # 2 panels' worth
    with pytest.raises(RuntimeError, match="f32_silu_mul"):
        kernels.f32_silu_mul(torch.randn(7, 63), panels, torch.empty(7, 24))
    with pytest.raises(RuntimeError, match="f32_silu_mul"):
        kernels.f32_silu_mul(x, panels.double(), torch.empty(7, 24))
    with pytest.raises(RuntimeError, match="f32_silu_mul"):
        kernels.f32_silu_mul(x, panels, torch.empty(24))


def test_only_a_bias_free_gate_up_takes_gated_panels(kernels: CpuKernels) -> None:
    weight = torch.randn(32, 16)
    assert isinstance(make_linear("packed", weight, None, gated=True), GatedPanels)
    assert isinstance(make_linear("packed", weight, torch.randn(32), gated=True), PackedLinear)
    assert isinstance(make_linear("packed", weight, None), PackedLinear)
