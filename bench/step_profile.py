"""Where the milliseconds of one decode step go, at given batch sizes.

    python bench/step_profile.py                      # batch 1 and 16, context 256
    python bench/step_profile.py --batch 1 4 16 64 --context 512 --linear dense packed
    python bench/step_profile.py --attention torch cpu  # gather + SDPA against the C++ kernel
    python bench/step_profile.py --attention cpu --fused on off  # the layers chained in C++
    python bench/step_profile.py --attention cpu --kv-dtype float32 bfloat16  # the KV's bytes

Runs the model forward directly (no actors): B sequences of `--context` cached tokens each
decode one token, with the step's attention metadata built as the executor builds it, then
greedy sampling (argmax). Each op torch's profiler sees is put in a bucket (matmul, attention, KV
gather/store, element-wise, other); `metadata` and `sample` are timed around their calls.
One line per (linear kind, attention, batch):

    step linear=<kind> attention=<torch|cpu> batch=<B> context=<n> step_ms=<x> metadata_ms=<x>
         sample_ms=<x> matmul_ms=<x> attention_ms=<x> kv_ms=<x> elementwise_ms=<x> other_ms=<x>
         machine=<desc>

The buckets are the profiler's self-CPU times over the profiled steps, divided by the
number of steps; step_ms is the wall time of an unprofiled step (the median of `--steps`).
Works on any revision whose model (LlamaModel, or a family's build) takes (config, weights, dtype,
device) — the linear
kind is passed only when asked for, and the attention is the torch reference unless `--attention
cpu` is asked for, and the model is imported from where the revision has it — so the same
script gives "before" and "after". `--fused off` makes a decode step take the Python forward
where the revision would chain its layers in C++ (models/fused_layers.py); the kernels the
chain calls still land in their buckets, and its own C++ is `other`.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from bench_format import emit, machine

BUCKETS: dict[str, tuple[str, ...]] = {
    "matmul": (
        "mm", "addmm", "linear", "matmul", "_mkl_linear", "_linear_pointwise", "bmm",
        "f32_linear", "q8_linear", "q4_linear", "f32_silu_mul", "bf16_panel_linear",
        "bf16_silu_mul",  # the gate_up's bfloat16 panels with their silu_mul epilogue
    ),
    "attention": (
        "_scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_attention",
        "paged_decode",
    ),
    "kv": ("index_select", "index_copy", "index_put", "_index_put_impl_", "gather", "store_kv"),
    "elementwise": (
        "mul", "add", "sub", "neg", "cat", "silu", "rsqrt", "pow", "mean", "div", "where",
        "copy_", "to", "_to_copy", "embedding", "index", "float", "clone", "fill_", "masked_fill",
        "rms_norm", "_fused_rms_norm", "add_rms_norm", "rope", "silu_mul",  # last 3: shoal_cpu
    ),
}  # fmt: skip


PAGE_SIZE = 16
POOL_PAGES = 2048  # 32768 tokens, the engine's default pool
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def bucket_of(op_name: str) -> str:
    name = op_name.split("::")[-1]
    for bucket, names in BUCKETS.items():
        if any(name == n or name.startswith(n + "_") for n in names):
            return bucket
    return "other"


def model_class(loaded: Any) -> Any:
    """The revision's model constructor: a family's `build`, or LlamaModel before families."""
    try:
        from shoal.models.registry import family_of

        family = family_of(loaded.config.model_type)
        if hasattr(family, "build"):
            return family.build
    except ImportError:
        pass
    try:
        from shoal.models.llama import LlamaModel  # type: ignore[attr-defined]
    except ImportError:  # revisions before models/
        from shoal.kernels.model import LlamaModel  # type: ignore[no-redef]
    return LlamaModel


def build(
    kind: str | None, attention: str, fused: str, kv_dtype: torch.dtype = torch.float32
) -> tuple[Any, Any, Any]:
    from shoal.kernels.attention import TorchAttention
    from shoal.models.load import load_model

    try:
        from shoal.models.kv_pool import KVPool
    except ImportError:  # revisions before models/
        from shoal.kernels.model import KVPool  # type: ignore[no-redef]

    loaded = load_model(None)
    cpu = torch.device("cpu")
    extra: tuple[Any, ...] = () if kind is None else (kind,)
    elementwise = None
    if kind == "int8" or attention == "cpu":  # int8 linears are compiled too
        from shoal.kernels.cpu_kernels import load_cpu_kernels
        from shoal.loading.loader import default_cache_dir

        kernels = load_cpu_kernels(default_cache_dir())
        if attention == "cpu":
            from shoal.kernels.elementwise import CompiledElementwise

            elementwise = CompiledElementwise(kernels)
    build_model = model_class(loaded)
    if elementwise is not None and "elementwise" in inspect.signature(build_model).parameters:
        extra = (kind or "packed", elementwise)  # revisions that chain layers build it at load
    model = build_model(loaded.config, loaded.weights, torch.float32, cpu, *extra)
    if fused == "off" and hasattr(model, "fused"):
        model.fused = None
    pool = KVPool(loaded.config, POOL_PAGES * PAGE_SIZE, kv_dtype, cpu)
    for layer in (*pool.k, *pool.v):  # touched: untouched zero pages would read unrealistically
        layer.normal_()
    if elementwise is not None:  # the compiled kernels: decode attention and element-wise ops
        model.elementwise = elementwise  # older revisions take them only this way
        store = getattr(kernels, "store_kv", None)  # older revisions: torch's index_copy_
        return model, pool, TorchAttention(PAGE_SIZE, kernels.paged_decode, store)
    return model, pool, TorchAttention(PAGE_SIZE)


def profile_step(
    model: Any, pool: Any, backend: Any, batch: int, context: int, steps: int
) -> dict[str, float]:
    from shoal.kernels.batch import BatchShape

    page_size = backend.page_size
    pages_per_row = -(-(context + 1) // page_size)
    gen = torch.Generator().manual_seed(0)
    # Every row gets its own random pages, as a busy cache would give them.
    page_ids = torch.randperm(POOL_PAGES, generator=gen)[: batch * pages_per_row]
    page_table = page_ids.view(batch, pages_per_row)
    shape = BatchShape(tuple(range(batch)), (context,) * batch, (1,) * batch)
    ids = torch.randint(100, 1000, (batch,), generator=gen)
    positions = torch.full((batch,), context)
    sample_index = torch.arange(batch)

    def step() -> tuple[float, float]:
        began = time.perf_counter()
        meta = backend.prepare(page_table, shape)
        prepared = time.perf_counter()
        logits = model.forward(ids, positions, meta, pool, sample_index)
        forwarded = time.perf_counter()
        logits.argmax(dim=-1)  # what sampling does for greedy rows
        return prepared - began, time.perf_counter() - forwarded

    for _ in range(3):
        step()
    walls, metas, samples = [], [], []
    for _ in range(steps):
        began = time.perf_counter()
        meta_s, sample_s = step()
        walls.append(time.perf_counter() - began)
        metas.append(meta_s)
        samples.append(sample_s)
    buckets = profile_buckets(step, steps)
    return {
        "step_ms": statistics.median(walls) * 1e3,
        "metadata_ms": statistics.median(metas) * 1e3,
        "sample_ms": statistics.median(samples) * 1e3,
        **{f"{b}_ms": ms for b, ms in buckets.items()},
    }


def profile_buckets(step: Callable[[], Any], steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        totals[bucket_of(event.key)] += event.self_cpu_time_total / 1e3
    return {b: totals[b] / steps for b in (*BUCKETS, "other")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kv-dtype", nargs="+", default=["float32"], choices=list(KV_DTYPES),
        help="the KV cache's elements (a bfloat16 KV needs a revision whose kernels read it)",
    )  # fmt: skip
    parser.add_argument(
        "--linear", nargs="+", default=None, help="linear kinds (default: the model's own)"
    )
    parser.add_argument(
        "--attention", nargs="+", default=["torch"], choices=["torch", "cpu"],
        help="torch (gather + SDPA, torch's element-wise ops) or cpu (the compiled kernels)",
    )  # fmt: skip
    parser.add_argument(
        "--fused", nargs="+", default=["on"], choices=["on", "off"],
        help="off: decode steps take the Python forward, not the layers chained in C++",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    desc = machine()
    runs = itertools.product(args.linear or [None], args.attention, args.fused, args.kv_dtype)
    for kind, attention, fused, kv in runs:
        model, pool, backend = build(kind, attention, fused, KV_DTYPES[kv])
        for batch in args.batch:
            result = profile_step(model, pool, backend, batch, args.context, args.steps)
            line = {"linear": kind or "default", "attention": attention, "batch": batch}
            if len(args.fused) > 1:
                line["fused"] = fused
            if len(args.kv_dtype) > 1:
                line["kv"] = kv
            line["context"] = args.context
            line |= {k: round(v, 2) for k, v in result.items()}
            emit("step", line | {"machine": desc}, None)


if __name__ == "__main__":
    main()
