"""A bfloat16 KV cache (`kv_cache_dtype`). The compiled decode attention's vector path reads
bfloat16 pages as their float32 values (the same bits as on a float32 copy); its AMX path
(csrc/tile_attention.cpp, where the CPU has the tiles) rounds q and the softmax's weights to
bfloat16 and is held to the float64 reference within bfloat16's error, in windows, soft-capped,
on pages of any size, never reading a page before the window (the compiled store's rounding
is test_cpu_kernels.py's); the torch reference widens what it gathers. Which dtype a start picks.
An engine on it, on the tiles (head_dim 32), against the float32 KV (near-ties only), with the
prefix cache, sessions and a weight update; disaggregated peers of two KV dtypes refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dense_attention import dense_outputs, poison_before_windows
from engines import EngineFactory
from test_cpu_kernels import Step, random_step
from tiny_model import make_tiny_model_folder
from weight_kinds import (
    check_a_weight_update_rebuilds,
    check_sessions_equal_stateless,
    flips_against,
    greedy_outputs,
    prompts,
)

from shoal import Engine
from shoal.config import EngineOptions
from shoal.disagg.layout import KVLayout
from shoal.kernels.attention import TorchAttention
from shoal.kernels.cpu_features import read_cpu_features
from shoal.kernels.cpu_kernels import CpuKernels, DecodeKernel
from shoal.models.load import LoadedModel, load_model
from shoal.resolve_options import resolve, resolve_kv_dtype

BF16 = torch.bfloat16
HAS_TILES = "amx_bf16" in read_cpu_features().flags
# The tile path's q and weights in bfloat16 (8 bits of mantissa): outputs of ~1 move by a few
# thousandths (measured: 0.003 at most on these shapes).
TILE_ATOL = 0.02


@pytest.fixture(scope="module")
def kernel(kernels: CpuKernels) -> DecodeKernel:
    return kernels.paged_decode


def bf16_step(seed: int, heads: int, kv_heads: int, dim: int, page: int) -> Step:
    gen = torch.Generator().manual_seed(seed)
    step = random_step(gen, [0, 150, 7, 0, 9, 299, 1], [1, 1, 1, 5, 1, 1, 1], heads, kv_heads,
                       dim, page)  # fmt: skip
    return step._replace(k_cache=step.k_cache.to(BF16), v_cache=step.v_cache.to(BF16))


def decode(
    kernel: DecodeKernel, step: Step, page: int, tiles: bool, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """The step's new K/V stored, its decodes attended by the kernel alone (their rows of the
    output)."""
    meta = TorchAttention(page, kernel).prepare(step.page_table, step.shape)
    meta.store(step.k_cache, step.v_cache, step.k_new, step.v_new)
    fused = meta.kernel_decodes
    assert fused is not None
    out = torch.zeros(step.q.shape)
    scale = step.q.shape[-1] ** -0.5
    torch.ops.shoal_cpu.paged_decode(step.q, step.k_cache, step.v_cache, fused.page_ids,
                                     fused.seq_lens, fused.token_index, page, scale, out, window,
                                     softcap, tiles=tiles)  # fmt: skip
    return out[fused.token_index]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"), [(9, 3, 64, 16), (6, 2, 20, 4), (8, 1, 128, 16)]
)
def test_the_vector_path_reads_bf16_pages_as_their_float32_values(
    kernel: DecodeKernel, heads: int, kv_heads: int, dim: int, page: int
) -> None:
    """Bit for bit the kernel on a float32 copy of the bfloat16 caches (a head_dim of 20
    leaves a tail past the vector width)."""
    step = bf16_step(heads + dim, heads, kv_heads, dim, page)
    got = decode(kernel, step, page, tiles=False)
    wide = step._replace(  # the new tokens' K/V as the bfloat16 store rounded them
        k_cache=step.k_cache.float(), v_cache=step.v_cache.float(),
        k_new=step.k_new.to(BF16).float(), v_new=step.v_new.to(BF16).float(),
    )  # fmt: skip
    assert torch.equal(got, decode(kernel, wide, page, tiles=False))


def test_the_reference_widens_bf16_pages() -> None:
    """The torch reference attends a bfloat16 cache's pages as their float32 values: the bits
    it gives on a float32 copy."""
    page, dim = 16, 64
    step = bf16_step(11, 9, 3, dim, page)
    reference = TorchAttention(page).prepare(step.page_table, step.shape)
    reference.store(step.k_cache, step.v_cache, step.k_new, step.v_new)
    got = reference.attend(step.q, step.k_cache, step.v_cache, dim**-0.5)
    assert got.dtype == torch.float32
    assert torch.equal(got, reference.attend(step.q, step.k_cache.float(), step.v_cache.float(),
                                             dim**-0.5))  # fmt: skip


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 1, 7, 41])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [(9, 3, 64, 16), (8, 1, 128, 16), (6, 2, 32, 4), (4, 4, 64, 1), (32, 2, 64, 16)],
)
def test_the_tiles_equal_dense_attention_within_bf16(
    kernel: DecodeKernel, heads: int, kv_heads: int, dim: int, page: int, window: int | None,
    softcap: float | None,
) -> None:  # fmt: skip
    """Pages of 16 (whole pages read in place), of 4 and of 1 (copied a key at a time), 1 to
    16 query heads a KV head, windows shorter and longer than a block of 16 keys; the step's
    chunks beside the decodes. Where the CPU has the tiles they ran (other bits than the vector
    path's); elsewhere the same op is the vector path."""
    step = bf16_step(window or 0, heads, kv_heads, dim, page)
    got = decode(kernel, step, page, True, window or 0, softcap or 0.0)
    meta = TorchAttention(page, kernel).prepare(step.page_table, step.shape)
    expected = dense_outputs(step.q, step.k_cache.float(), step.v_cache.float(), step.page_table,
                             step.shape, page, dim**-0.5, window, softcap)  # fmt: skip
    fused = meta.kernel_decodes
    assert fused is not None
    torch.testing.assert_close(got.double(), expected[fused.token_index], rtol=0, atol=TILE_ATOL)
    if window is None:  # (a window of one key gives its value row exactly, either way)
        vector = decode(kernel, step, page, False, 0, softcap or 0.0)
        assert torch.equal(got, vector) != HAS_TILES


def test_heads_the_tiles_cannot_take_go_the_vector_way(kernel: DecodeKernel) -> None:
    """A head_dim not in whole 32s, or more than 16 query heads a KV head: the same bits as
    the vector path."""
    for heads, kv_heads, dim in [(6, 2, 48), (17, 1, 32)]:
        step = bf16_step(5, heads, kv_heads, dim, 16)
        assert torch.equal(decode(kernel, step, 16, True), decode(kernel, step, 16, False))


@pytest.mark.parametrize("garbage", [1e4, float("nan")])
def test_the_tiles_never_read_before_the_window(kernel: DecodeKernel, garbage: float) -> None:
    """Pages wholly before each decode's window hold garbage, even NaN, and the keys of a
    window's first page before its first key are zeroed rows of no weight: nothing leaks."""
    window, page, dim = 24, 16, 32
    step = bf16_step(2, 6, 2, dim, page)
    expected = decode(kernel, step, page, True, window)
    assert poison_before_windows(step.k_cache, step.v_cache, step.page_table, step.shape, page,
                                 window, garbage) > 0  # fmt: skip
    got = decode(kernel, step, page, True, window)
    assert torch.equal(got, expected)


def test_the_kernel_refuses_caches_of_two_dtypes(kernel: DecodeKernel) -> None:
    step = random_step(torch.Generator().manual_seed(3), [5, 20], [1, 1], 6, 2, 8, 4)
    fused = TorchAttention(4, kernel).prepare(step.page_table, step.shape).kernel_decodes
    assert fused is not None
    out = torch.empty(step.q.shape)
    with pytest.raises(RuntimeError, match="both float32 or bfloat16"):
        kernel(step.q, step.k_cache.to(BF16), step.v_cache, fused.page_ids, fused.seq_lens,
               fused.token_index, 4, 0.5, out)  # fmt: skip


# ---- which dtype a start picks -------------------------------------------------------------


def test_kv_cache_dtype_follows_the_weights_unless_given() -> None:
    float32 = resolve(EngineOptions(device="cpu", dtype="float32"), 2048)
    assert float32.kv_dtype == torch.float32
    given = resolve(EngineOptions(device="cpu", dtype="float32", kv_cache_dtype="bfloat16"), 2048)
    assert (given.dtype, given.kv_dtype, given.attention) == (torch.float32, BF16, "cpu")
    bf16 = resolve(EngineOptions(device="cpu", dtype="bfloat16"), 2048)
    assert (bf16.dtype, bf16.kv_dtype) == (torch.float32, BF16)
    kept = resolve(EngineOptions(device="cpu", dtype="bfloat16", kv_cache_dtype="float32"), 2048)
    assert kept.kv_dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32 or bfloat16"):
        resolve(EngineOptions(device="cpu", kv_cache_dtype="fp8"), 2048)  # type: ignore[arg-type]
    # CUDA's kernels keep the weights' dtype
    cuda = torch.device("cuda")
    assert resolve_kv_dtype(EngineOptions(), cuda, BF16) == BF16
    assert resolve_kv_dtype(EngineOptions(kv_cache_dtype="bfloat16"), cuda, BF16) == BF16
    with pytest.raises(ValueError, match="on CUDA must be the weights' dtype"):
        resolve_kv_dtype(EngineOptions(kv_cache_dtype="float32"), cuda, BF16)


def test_disaggregated_peers_of_two_kv_dtypes_are_refused() -> None:
    """The layout both sides compare names the KV's dtype: a float32 prefill peer never hands
    its pages to a bfloat16 decode side."""
    base = dict(num_layers=2, num_kv_heads=3, head_dim=64, page_size=16, num_pages=8,
                k_addrs=(1, 2), v_addrs=(3, 4))  # fmt: skip
    wide = KVLayout(dtype="torch.float32", page_bytes=16 * 3 * 64 * 4, **base)
    narrow = KVLayout(dtype="torch.bfloat16", page_bytes=16 * 3 * 64 * 2, **base)
    assert narrow.mismatch(wide) == (
        "KV layouts differ: dtype torch.bfloat16 here, torch.float32 on the peer"
    )


# ---- an engine on it: a tiny model of head_dim 32, which the tiles take ---------------------

WIDE_HEADS = {"num_heads": 4, "num_kv_heads": 2, "hidden_size": 128}


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny-wide-heads"), **WIDE_HEADS)


@pytest.fixture(scope="module")
def wide_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-wide-heads-other")
    return make_tiny_model_folder(folder, seed=1, **WIDE_HEADS)


@pytest.fixture(scope="module")
def wide(wide_folder: Path) -> LoadedModel:
    loaded = load_model(wide_folder, progress=False)
    assert loaded.config.head_dim == 32
    return loaded


@pytest.fixture
def make_wide(make_engine: EngineFactory, wide: LoadedModel) -> EngineFactory:
    """make_engine with the head_dim-32 model as the default model."""

    async def on_wide(model: LoadedModel | None = None, **options: Any) -> Engine:
        return await make_engine(model or wide, **options)

    return on_wide


@pytest.mark.parametrize("attention", ["cpu", "torch"])
async def test_an_engine_on_a_bf16_kv_follows_the_float32_kv(
    make_wide: EngineFactory, attention: str
) -> None:
    """Float32 weights over a bfloat16 KV pick float32's tokens until a near-tie, with the
    compiled kernel (on the tiles where the CPU has them) and with the reference."""
    batch = prompts(8, 2)
    narrow = await make_wide(page_size=4, kv_cache_dtype="bfloat16", attention=attention)
    assert narrow.resolved.kv_dtype == BF16
    float32 = await make_wide(page_size=4, attention=attention)
    assert await flips_against(narrow, float32, batch) <= len(batch) // 2


async def test_the_compiled_kernel_follows_the_reference_on_a_bf16_kv(
    make_wide: EngineFactory,
) -> None:
    batch = prompts(8, 3)
    compiled = await make_wide(page_size=4, kv_cache_dtype="bfloat16", attention="cpu")
    reference = await make_wide(page_size=4, kv_cache_dtype="bfloat16", attention="torch")
    assert await flips_against(compiled, reference, batch) <= len(batch) // 4


async def test_the_prefix_cache_on_a_bf16_kv_gives_what_a_cold_start_gives(
    make_wide: EngineFactory,
) -> None:
    """Pages written in bfloat16 and reused by a later prompt give the tokens a fresh engine
    computes for it."""
    shared = list(range(40, 61))
    later = [shared + p for p in prompts(3, 4)]
    warm = await make_wide(page_size=4, kv_cache_dtype="bfloat16")
    await greedy_outputs(warm, [shared])
    got = await greedy_outputs(warm, later)
    reused = await warm.generate(input_ids=later[0], max_new_tokens=1).result()
    assert reused.usage.cached_tokens >= 20
    cold = await make_wide(page_size=4, kv_cache_dtype="bfloat16", prefix_cache=False)
    assert got == await greedy_outputs(cold, later)


async def test_sessions_on_a_bf16_kv_equal_stateless(make_wide: EngineFactory) -> None:
    await check_sessions_equal_stateless(make_wide, kv_cache_dtype="bfloat16")


async def test_a_weight_update_over_a_bf16_kv(
    make_wide: EngineFactory, wide_folder: Path, wide_other: Path
) -> None:
    await check_a_weight_update_rebuilds(
        make_wide, wide_other, wide_folder, kv_cache_dtype="bfloat16"
    )
