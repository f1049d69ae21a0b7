"""Each Triton kernel against its torch reference (kernels/attention.py).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by conftest) at
small shapes; on a CUDA device the `gpu` tests repeat the comparison at SmolLM2's real shapes
and long contexts. Cases: page sizes 1 and 16, GQA ratios 1 and 3, prefixes of length 0,
page-aligned and not, ragged batches mixing decode and extend sequences. Sliding windows
(shorter than, as long as and longer than the sequences) and soft-capped logits are held to
dense_attention.py's dense attention, also with the pages before each window
overwritten with garbage (they may have been freed and reused).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dense_attention import dense_outputs, poison_before_windows

pytest.importorskip("triton", reason="the triton package is not installed")

from shoal.kernels.attention import TorchAttention
from shoal.kernels.batch import BatchShape
from shoal.kernels.triton.attention import TritonAttention, decode_splits
from shoal.kernels.triton.decode import decode_attention_triton
from shoal.kernels.triton.extend import extend_attention_triton
from shoal.kernels.triton.store import store_kv_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (prefix_lens, extend_lens): decode-only, extend-only, and mixed ragged batches.
BATCHES = {
    "decode": ((0, 5, 16, 37), (1, 1, 1, 1)),
    "prefill": ((0, 0), (9, 23)),
    "chunked": ((7, 16, 33), (20, 5, 40)),
    "mixed": ((0, 33, 3, 16, 0), (18, 1, 1, 70, 1)),
}


@dataclass
class Case:
    shape: BatchShape
    page_table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def make_case(
    prefix_lens: tuple[int, ...],
    extend_lens: tuple[int, ...],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    """Rows scattered over a table with spare rows; each row's pages shuffled over the pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_pages = [-(-(p + n) // page_size) for p, n in zip(prefix_lens, extend_lens, strict=True)]
    num_pages = sum(seq_pages) + 3
    page_order = torch.randperm(num_pages, generator=gen)
    num_rows = 2 * len(prefix_lens) + 1
    rows = tuple(int(r) for r in torch.randperm(num_rows, generator=gen)[: len(prefix_lens)])
    table = torch.zeros(num_rows, max(seq_pages) + 2, dtype=torch.int64)
    used = 0
    for row, n in zip(rows, seq_pages, strict=True):
        table[row, :n] = page_order[used : used + n]
        used += n
    num_tokens = sum(extend_lens)
    heads = num_kv_heads * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    return Case(
        BatchShape(rows, prefix_lens, extend_lens),
        table.to(DEVICE),
        rand(num_pages * page_size, num_kv_heads, head_dim),
        rand(num_pages * page_size, num_kv_heads, head_dim),
        rand(num_tokens, heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
    )


def run_both(case: Case, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store + attend with each backend, the reference on copies of the caches; the stores
    must agree exactly. Leaves the Triton-stored caches in `case`."""
    num_kv_heads, head_dim = case.k_cache.shape[1:]
    scale = head_dim**-0.5
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    reference = TorchAttention(page_size).prepare(case.page_table, case.shape)
    reference.store(ref_k, ref_v, case.k, case.v)
    expected = reference.attend(case.q, ref_k, ref_v, scale)

    triton_batch = TritonAttention(page_size, num_kv_heads).prepare(case.page_table, case.shape)
    triton_batch.store(case.k_cache, case.v_cache, case.k, case.v)
    got = triton_batch.attend(case.q, case.k_cache, case.v_cache, scale)
    assert torch.equal(case.k_cache, ref_k) and torch.equal(case.v_cache, ref_v)
    return got, expected


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_matches_the_reference(batch: str, group: int, page_size: int) -> None:
    prefix_lens, extend_lens = BATCHES[batch]
    case = make_case(prefix_lens, extend_lens, page_size, num_kv_heads=2, group=group, head_dim=16)
    got, expected = run_both(case, page_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_head_dim_that_is_not_a_power_of_two() -> None:
    case = make_case((5, 0), (1, 12), page_size=4, num_kv_heads=1, group=3, head_dim=24)
    got, expected = run_both(case, page_size=4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_decode_result_does_not_depend_on_the_number_of_splits(
    num_splits: int, window: int | None
) -> None:
    """More splits than keys leaves some empty; their log-sum-exp of -inf weighs nothing.
    With a window, the splits share the window's keys only."""
    case = make_case((0, 6, 40), (1, 1, 1), page_size=4, num_kv_heads=2, group=3, head_dim=16)
    _, expected = store_and_attend(case, 4, window, None)
    rows = torch.tensor(case.shape.rows, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([1, 7, 41], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(case.q, float("nan"))
    decode_attention_triton(
        case.q, case.k_cache, case.v_cache, out, case.page_table, rows, seq_lens,
        torch.arange(3, dtype=torch.int32, device=DEVICE), 4, 16**-0.5, num_splits, block_n=16,
        window=window or 0,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def store_and_attend(
    case: Case, page_size: int, window: int | None, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton backend's output and the dense reference's (float64), the latter over the
    caches as stored."""
    num_kv_heads, head_dim = case.k_cache.shape[1:]
    batch = TritonAttention(page_size, num_kv_heads).prepare(case.page_table, case.shape)
    batch.store(case.k_cache, case.v_cache, case.k, case.v)
    expected = dense_outputs(
        case.q, case.k_cache, case.v_cache, case.page_table, case.shape, page_size,
        head_dim**-0.5, window, softcap,
    )  # fmt: skip
    got = batch.attend(case.q, case.k_cache, case.v_cache, head_dim**-0.5, window, softcap)
    return got, expected


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (4, 5.0), (34, None), (34, 5.0),
                                                 (1000, 5.0)])  # fmt: skip
@pytest.mark.parametrize("batch", ["chunked", "mixed"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_windows_and_softcap_match_dense_attention(
    batch: str, group: int, page_size: int, window: int, softcap: float | None
) -> None:
    """Windows of one key, shorter than most sequences, as long as a decode (34), longer than
    all; "mixed" has a 70-token chunk over a prefix of 16 (two blocks of 64 new tokens)."""
    prefix_lens, extend_lens = BATCHES[batch]
    case = make_case(prefix_lens, extend_lens, page_size, num_kv_heads=2, group=group, head_dim=16)
    got, expected = store_and_attend(case, page_size, window, softcap)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("garbage", [1e4, float("nan")])
@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_before_the_window_are_never_read(page_size: int, garbage: float) -> None:
    """Pages wholly before each sequence's window hold garbage, even NaN: no kernel loads
    them, so nothing changes."""
    window = 20
    case = make_case((0, 33, 3, 40, 50), (18, 1, 1, 70, 1), page_size, 2, 3, 16)
    num_kv_heads, head_dim = case.k_cache.shape[1:]
    batch = TritonAttention(page_size, num_kv_heads).prepare(case.page_table, case.shape)
    batch.store(case.k_cache, case.v_cache, case.k, case.v)
    expected = dense_outputs(
        case.q, case.k_cache, case.v_cache, case.page_table, case.shape, page_size,
        head_dim**-0.5, window, 5.0,
    )  # fmt: skip
    table = case.page_table.cpu()
    assert poison_before_windows(case.k_cache, case.v_cache, table, case.shape, page_size, window,
                                 garbage) > 0  # fmt: skip
    got = batch.attend(case.q, case.k_cache, case.v_cache, head_dim**-0.5, window, 5.0)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_extend_rows_whose_window_starts_past_the_first_key_block() -> None:
    """Key blocks (16) shorter than query blocks (64) and a window of 5: the last rows of a
    query block see no key of its first key blocks, and must come out unharmed."""
    case = make_case((10, 0), (70, 40), page_size=4, num_kv_heads=1, group=2, head_dim=16)
    _, expected = store_and_attend(case, 4, 5, None)
    rows = torch.tensor(case.shape.rows, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(case.q, float("nan"))
    extend_attention_triton(
        case.q, case.k_cache, case.v_cache, out, case.page_table, rows,
        torch.tensor([10, 0], dtype=torch.int32, device=DEVICE),
        torch.tensor([70, 40], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 70], dtype=torch.int32, device=DEVICE), 70, 4, 16**-0.5, block_m=64,
        block_n=16, window=5,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_padding_stores_nothing_and_attends_to_nothing() -> None:
    """What a CUDA graph replayed for a larger batch relies on: slot -1 and length 0."""
    case = make_case((3, 9), (1, 1), page_size=4, num_kv_heads=2, group=1, head_dim=16)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    slots = torch.tensor([-1, -1], dtype=torch.int64, device=DEVICE)
    store_kv_triton(case.k_cache, case.v_cache, slots, case.k, case.v)
    assert torch.equal(case.k_cache, k_before) and torch.equal(case.v_cache, v_before)

    out = torch.full_like(case.q, float("nan"))
    rows = torch.tensor(case.shape.rows, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([4, 0], dtype=torch.int32, device=DEVICE)
    token_index = torch.arange(2, dtype=torch.int32, device=DEVICE)
    decode_attention_triton(
        case.q, case.k_cache, case.v_cache, out, case.page_table, rows, seq_lens, token_index,
        4, 16**-0.5, num_splits=3,
    )  # fmt: skip
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out[0]).all()


def test_decode_splits_fill_the_device_for_small_batches_only() -> None:
    assert decode_splits(max_seq_len=100, num_seqs=1, num_kv_heads=3) == 1  # short: one piece
    assert decode_splits(max_seq_len=4096, num_seqs=1, num_kv_heads=3) == 16
    assert decode_splits(max_seq_len=4096, num_seqs=256, num_kv_heads=3) == 1
    assert 1 < decode_splits(max_seq_len=4096, num_seqs=8, num_kv_heads=3) < 16


# ---- real shapes, on a GPU ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_at_smollm2_shapes_on_cuda(dtype: torch.dtype, page_size: int) -> None:
    """SmolLM2-135M: 9 query heads over 3 KV heads of 64; long and ragged contexts."""
    prefix_lens = (0, 4095, 17, 1000, 2048, 0, 300)
    extend_lens = (1, 1, 1, 513, 64, 2000, 1)
    case = make_case(prefix_lens, extend_lens, page_size, 3, 3, 64, dtype=dtype, seed=1)
    got, expected = run_both(case, page_size)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_windows_at_smollm2_shapes_on_cuda(dtype: torch.dtype, page_size: int) -> None:
    """Gemma-2-like layers (a window of 1000 keys, logits capped at 50) over long contexts."""
    prefix_lens = (0, 4095, 17, 1000, 2048, 0, 300, 999)
    extend_lens = (1, 1, 1, 513, 64, 2000, 1, 1)
    case = make_case(prefix_lens, extend_lens, page_size, 3, 3, 64, dtype=dtype, seed=3)
    got, expected = store_and_attend(case, page_size, 1000, 50.0)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
def test_decode_at_batch_256_on_cuda() -> None:
    prefix_lens = tuple(int(x) for x in torch.randint(0, 3000, (256,)))
    case = make_case(prefix_lens, (1,) * 256, 16, 3, 3, 64, dtype=torch.bfloat16, seed=2)
    got, expected = run_both(case, page_size=16)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


# ---- compiled for a Hopper GPU, here without one --------------------------------------------

H100_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use


def test_every_kernel_compiles_for_hopper() -> None:
    """Triton's NVIDIA back end and its ptxas need no GPU: each kernel compiles to an sm_90
    cubin, fits in a block's shared memory, and the bf16 extend kernel uses wgmma (Hopper's
    tensor-core instruction; without it a matrix kernel is on a slower path)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_kernels.py")
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    kernels = {r["kernel"] for r in results}
    assert kernels == {
        "_decode_partial_kernel", "_decode_merge_kernel", "_extend_kernel", "_store_kv_kernel"
    }  # fmt: skip
    for r in results:
        assert r["cubin_bytes"] > 0 and r["shared_bytes"] <= H100_SHARED_BYTES, r
    bf16_extend = [r for r in results if r["kernel"] == "_extend_kernel" and r["dtype"] == "*bf16"]
    assert bf16_extend and all(r["wgmma"] for r in bf16_extend)
