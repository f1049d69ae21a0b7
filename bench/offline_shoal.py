"""shoal as bench/offline.py measures it: an Engine on the loaded model, warmed up, then the
timed work, the decode steps at each batch size (bench/roofline.py) and the page-accounting
line (bench/window_pages.py); and its setup string,
<device>-<dtype>-<attention>-graphs<max batch, 0 off>-inflight<n>-<linear>:<how>[-kv<dtype>]
[-stages<n>][-ngram<k>] (dtype: the activations'; linear and how as
kernels/cpu_features.kernel_choice names them; kv: the KV cache's dtype, where it is not the
activations'; k: the drafts a speculating row may send)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from bench_format import WARM_UP_PROMPT, Setup, dtype_name, emit, report
from roofline import DecodePlan, decode_line, measure_decode
from tqdm import tqdm
from window_pages import window_pages

from shoal.kernels.cpu_features import kernel_choice


def engine_setup(engine: Any) -> str:
    r, o = engine.resolved, engine.options
    stages = o.pipeline_stages
    inflight = stages + o.pipeline_depth if stages > 1 else o.max_inflight  # actors/wiring.py
    # the linears as kernel_choice names them: bf16:onednn-amx, packed:panels-avx512_vnni, ...
    picked = kernel_choice(
        r.device, r.linear_kind, engine.attention, f32_many_rows=r.f32_many_rows
    ).split()[0]
    return (
        f"{r.device.type}-{dtype_name(r.dtype)}-{engine.attention}"
        f"-graphs{r.cuda_graph_max_batch}-inflight{inflight}-{picked.removeprefix('linear=')}"
        + (f"-kv{dtype_name(r.kv_dtype)}" if r.kv_dtype != r.dtype else "")
        + (f"-stages{stages}" if stages > 1 else "")
        + (f"-ngram{o.speculative_num_draft_tokens}" if o.speculative_algorithm else "")
    )


async def run_shoal(engine: Any, work: list[tuple[list[int], int]]) -> tuple[int, float]:
    began = time.perf_counter()
    streams = [
        engine.generate(input_ids=p, max_new_tokens=m, temperature=0.0, ignore_eos=True)
        for p, m in work
    ]
    tokens = 0
    for next_done in tqdm(
        asyncio.as_completed([s.result() for s in streams]),
        total=len(streams),
        desc="shoal",
        disable=len(work) < 8,
    ):
        tokens += len((await next_done).token_ids)
    return tokens, time.perf_counter() - began


async def run_decode(engine: Any, plan: DecodePlan, desc: str, out: Path | None) -> None:
    rng = random.Random(plan.seed)
    speculating = engine.options.speculative_algorithm is not None
    for batch in plan.batch_sizes:
        before = await engine.snapshot() if speculating else None
        window = await measure_decode(engine, plan, batch, rng)
        spec = {}
        if before is not None:  # over both of measure_decode's runs, the untimed one too
            after = await engine.snapshot()
            for name in ("spec_steps", "spec_drafted", "spec_accepted"):
                spec[name] = getattr(after, name) - getattr(before, name)
        r = engine.resolved
        dtype_bytes = 2 if r.linear_kind == "bf16" else r.dtype.itemsize  # the weights'
        line = decode_line(
            engine.loaded.config, plan, batch, window, dtype_bytes, r.kv_dtype.itemsize
        )
        emit("decode", {**line, **spec, "setup": engine_setup(engine), "machine": desc}, out)


async def run_engine(
    loaded: Any,
    load_s: float,
    options: dict[str, Any],
    work: list[tuple[list[int], int]],
    plan: DecodePlan,
    desc: str,
    out: Path | None,
    window_tokens: int = 0,
) -> float | None:
    """shoal's throughput line (when there is work), decode lines and the page-accounting line
    (bench/window_pages.py, when `window_tokens`); its tok/s or None.
    `load_s`: the seconds `loaded` took to load, counted in its setup time."""
    from shoal import Engine

    async with Engine(loaded, **options) as engine:
        setup = Setup(engine_setup(engine), load_s + engine.startup_s)
        await engine.generate(input_ids=WARM_UP_PROMPT, max_new_tokens=2).result()
        tok_per_s = None
        if work and engine.resolved.device.type == "cuda":
            # Untimed: Triton compiles a kernel variant the first time it meets each shape
            # class. On an H100 the first 256-request run of a model shape on a fresh
            # machine (empty Triton cache) ran at 54-58% of the speed of later processes.
            # Reversed prompts share no cached prefix with the timed ones.
            await run_shoal(engine, [(p[::-1], 4) for p, _ in work[:32]])
        if work:
            tokens, seconds = await run_shoal(engine, work)
            tok_per_s = report("shoal", len(work), tokens, seconds, setup, desc, out)
        await run_decode(engine, plan, desc, out)
        if window_tokens:
            await window_pages(engine, window_tokens, desc, out)
    return tok_per_s
