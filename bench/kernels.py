"""The attention kernels alone, at SmolLM2's head shapes (9 query heads over 3 KV heads of 64),
on one device, in one process: on a GPU Triton against the torch reference; on the CPU the
compiled kernels (`cpu`: csrc/paged_decode.cpp, csrc/paged_extend.cpp) against it.

    python bench/kernels.py --device cuda                    # decode and extend, bf16
    python bench/kernels.py --device cuda --batch 1 64 256 --extend-batch 1 8 --context 1024 4096
    python bench/kernels.py --device cpu --dtype float32 --batch 1 16 --extend-batch 1 \
        --context 189 512 1024                               # the KV's dtype; q is float32
    python bench/kernels.py --device cpu --impls cpu --batch 16 64 --context 120 250 \
        --layers 30                          # a step's 30 layers' caches: read from memory
    TRITON_INTERPRET=1 python bench/kernels.py --smoke       # tiny shapes on CPU: runs, no figures
    python bench/kernels.py --device cpu --impls cpu --batch 64 --extend-batch 0 --context 200 \
        --layers 30 --pool-tokens 200000 --kv-memory torch pool   # a server's pool, both ways

Prints one line per kernel, implementation and shape:
    kernel op=<decode|extend> impl=<triton|torch> batch=<B> context=<L> ms=<x> gbps=<y>
           tflops=<z> dtype=<d> layers=<n> machine=<desc>
decode: one new token per sequence over a context of L; gbps counts the K and V bytes it must
read (B x L x 2 x Hkv x D x dtype bytes), the figure to hold against the HBM bandwidth.
--layers N: N caches on the same pages, attended in turn, and the time is a layer's (one
layer's cache may fit in the CPU's last-level cache where a model's layers do not).
extend: a prefill of L new tokens per sequence, no cached prefix; tflops counts the causal
attention's multiply-adds (2 x 2 x B x H x D x L^2 / 2). Pages are shuffled over the pool: the
step's own, or with --pool-tokens N a pool of N tokens' slots (a server's, after a while of
serving). --kv-memory: the caches from torch's allocator (`torch`), or as the engine's KV pool
allocates them on the CPU (`pool`: models/huge_pages.py, in transparent huge pages where Linux
gives them), each in turn on the same pages; the lines name it (kv_memory, pool_tokens).
Times: the median of --iters runs after a warm-up, CUDA events on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_format import machine

from shoal.kernels.attention import TorchAttention
from shoal.kernels.batch import Attention, AttentionBackend, BatchShape

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


Caches = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's K and V


def make_batch(
    batch: int, context: int, decode: bool, page_size: int, dtype: torch.dtype, device: str,
    layers: int = 1, pool_tokens: int = 0, memory: str = "torch",
) -> tuple[BatchShape, torch.Tensor, Caches, torch.Tensor]:  # fmt: skip
    """The shape, page table, each layer's K/V caches and the queries of one step; pages
    shuffled over a pool of at least `pool_tokens` slots, its caches from `memory`."""
    pages_per_seq = -(-context // page_size)
    num_pages = max(batch * pages_per_seq + 1, -(-pool_tokens // page_size))
    order = torch.randperm(num_pages)[: batch * pages_per_seq].view(batch, pages_per_seq)
    table = order.to(device=device, dtype=torch.int64)
    shape_of = (num_pages * page_size, NUM_KV_HEADS, HEAD_DIM)
    caches = [(kv_cache(shape_of, dtype, device, memory), kv_cache(shape_of, dtype, device, memory))
              for _ in range(layers)]  # fmt: skip
    new = 1 if decode else context
    shape = BatchShape(tuple(range(batch)), (context - new,) * batch, (new,) * batch)
    q_dtype = dtype if device == "cuda" else torch.float32  # the CPU's q: float32
    q = torch.randn(batch * new, NUM_HEADS, HEAD_DIM, dtype=q_dtype, device=device)
    return shape, table, caches, q


def kv_cache(
    shape: tuple[int, int, int], dtype: torch.dtype, device: str, memory: str
) -> torch.Tensor:
    """Random K or V rows: torch's memory, or the engine's KV pool's (CPU only)."""
    if memory == "torch":
        return torch.randn(shape, dtype=dtype, device=device)
    from shoal.models.huge_pages import zeros

    return zeros(shape, dtype).normal_()


def timed(fn: Callable[[], Any], iters: int, device: str) -> float:
    """Median milliseconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def backends(impls: list[str], page_size: int) -> dict[str, AttentionBackend]:
    """triton (imports the package), torch (the reference), cpu (the compiled kernels)."""
    out: dict[str, AttentionBackend] = {}
    for impl in impls:
        if impl == "triton":
            from shoal.kernels.triton.attention import TritonAttention

            out[impl] = TritonAttention(page_size, NUM_KV_HEADS)
        elif impl == "cpu":
            from shoal.kernels.cpu_kernels import load_cpu_kernels
            from shoal.loading.loader import default_cache_dir

            k = load_cpu_kernels(default_cache_dir())
            out[impl] = TorchAttention(page_size, k.paged_decode, k.store_kv, k.paged_extend)
        else:
            out[impl] = TorchAttention(page_size)
    return out


def run_all(steps: list[Callable[[], Any]]) -> None:
    for step in steps:
        step()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    dtype = getattr(torch, args.dtype)
    scale = HEAD_DIM**-0.5
    lines = []
    chosen = backends(args.impls, args.page_size)
    for op, batches in (("decode", args.batch), ("extend", args.extend_batch)):
        for batch in batches:
            for context, memory in itertools.product(args.context, args.kv_memory):
                decode = op == "decode"
                torch.manual_seed(0)  # the same pages for each memory
                shape, table, caches, q = make_batch(
                    batch, context, decode, args.page_size, dtype, args.device, args.layers,
                    args.pool_tokens, memory,
                )  # fmt: skip
                impls: dict[str, Attention] = {
                    name: backend.prepare(table, shape) for name, backend in chosen.items()
                }
                for impl, attention in impls.items():
                    steps = [partial(attention.attend, q, k, v, scale) for k, v in caches]
                    ms = timed(partial(run_all, steps), args.iters, args.device) / len(steps)
                    kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
                    flops = 2 * batch * NUM_HEADS * HEAD_DIM * context * context
                    line = {
                        "op": op,
                        "impl": impl,
                        "batch": batch,
                        "context": context,
                        "ms": round(ms, 4),
                        "gbps": round(kv_bytes / ms / 1e6, 1) if op == "decode" else "-",
                        "tflops": round(flops / ms / 1e9, 2) if op == "extend" else "-",
                        "dtype": args.dtype,
                        "layers": args.layers,
                        "kv_memory": memory,
                        "pool_tokens": args.pool_tokens,
                        "machine": machine(),
                    }
                    print("kernel " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
                    lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256], help="decode")
    parser.add_argument("--extend-batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--layers", type=int, default=1, help="caches attended in turn")
    parser.add_argument(
        "--impls", nargs="+", default=None, choices=["triton", "torch", "cpu"],
        help="default: triton torch on cuda (and --smoke), torch cpu on the CPU",
    )  # fmt: skip
    parser.add_argument("--pool-tokens", type=int, default=0, help="slots the pool holds")
    parser.add_argument(
        "--kv-memory", nargs="+", default=["torch"], choices=["torch", "pool"],
        help="the caches' memory: torch's allocator, or the engine's KV pool's (CPU)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny shapes, 1 iter")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.iters, args.page_size = "cpu", "float32", 1, 4
        args.batch, args.extend_batch, args.context = [2], [2], [40]
    if args.impls is None:
        on_gpu = args.device == "cuda" or args.smoke
        args.impls = ["triton", "torch"] if on_gpu else ["torch", "cpu"]
    if "pool" in args.kv_memory and args.device != "cpu":
        parser.error("--kv-memory pool: the KV pool's own memory is the CPU's")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --smoke on CPU)")
    lines = run(args)
    if args.out is not None:
        with args.out.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
