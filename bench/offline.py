"""Offline throughput: N seeded requests through shoal's Engine, and the same prompts through
vLLM's `LLM.generate` (a subprocess in vLLM's own environment, bench/vllm_peer.py) and
transformers `generate` (batched with left padding, and one at a time) on the same device and
dtype; and, with --decode-batch, the decode step time at given batch sizes against its
HBM-bandwidth roofline (bench/roofline.py).

    python bench/offline.py                # CPU, bundled SmolLM2, 64 requests, generate at 8 16 32
    python bench/offline.py --requests 16 --hf-solo 4
    python bench/offline.py --hf-batch 16 --hf-solo 0  # one batch size, no one-at-a-time
    python bench/offline.py --peers vllm --vllm-python /path/to/vllm-env/bin/python
    python bench/offline.py --peers --quantization int8   # shoal alone, int8 weights
    python bench/offline.py --model <folder> --smoke   # 4 tiny requests, 1 solo
    python bench/offline.py --model tiny:mixtral --smoke  # a tiny random model of a family
    python bench/offline.py --model tiny:mistral --smoke --window-pages 600  # pages it holds
    python bench/offline.py --device cuda --requests 256 --max-running 256 \\
        --kv-cache-tokens 131072 --hf-batch 64 256    # bf16 on the GPU, both systems
    python bench/offline.py --device cuda --requests 0 --decode-batch 1 64 256 \\
        --max-running 256 --cuda-graph-max-batch 256  # decode steps only
    ... --no-cuda-graphs / --no-overlap              # the same with graphs / overlap off

Prints one line per system (setup_s: loading and constructing it, not timed):
    offline system=<name> requests=<n> output_tokens=<n> seconds=<s> tok_per_s=<x>
            setup_s=<s> setup=<desc> machine=<desc>
or, for a peer that cannot run here (no vLLM Python, say), the reason, after which it goes on:
    offline system=vllm skipped reason=<why, the rest of the line>
then the ratios (shoal's tok/s over vLLM's, the fastest batched generate's, one at a time's;
each only when that system ran):
    offline summary shoal_over_vllm=<x> shoal_over_hf_batch=<x> shoal_over_hf_solo=<x>
            machine=<desc>
and one line per decode batch size (roofline and fraction "unknown" without a bandwidth):
    decode batch=<B> prompt_tokens=<n> output_tokens=<n> steps=<n> context_tokens=<x>
           step_ms=<x> roofline_ms=<y> fraction_of_roofline=<y/x> hbm_gbps=<x>
           weight_mb=<x> kv_mb=<x> setup=<desc> machine=<desc>
setup: shoal's <device>-<dtype>-<attention>-graphs<max batch, 0 off>-inflight<n>-<linear>
[-stages<n>], as the engine resolved them (linear: dense, packed or int8 weights); vLLM's
<device>-<dtype>-vllm<version>; generate's <device>-<dtype>-hf.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_format import (
    WARM_UP_PROMPT,
    Setup,
    dtype_name,
    emit,
    machine,
    report,
    workload,
)
from hf_peer import compare_hf
from roofline import DecodePlan, decode_line, hbm_gbps_for, measure_decode
from tqdm import tqdm
from vllm_peer import OfflineJob, find_python, run_offline
from window_pages import window_pages

PEERS = ("vllm", "hf")


# ---- shoal ---------------------------------------------------------------------------------


def engine_setup(engine: Any) -> str:
    r, o = engine.resolved, engine.options
    stages = o.pipeline_stages
    inflight = stages + o.pipeline_depth if stages > 1 else o.max_inflight  # actors/wiring.py
    return (
        f"{r.device.type}-{dtype_name(r.dtype)}-{engine.attention}"
        f"-graphs{r.cuda_graph_max_batch}-inflight{inflight}-{r.linear_kind}"
        + (f"-stages{stages}" if stages > 1 else "")
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
    for batch in plan.batch_sizes:
        window = await measure_decode(engine, plan, batch, rng)
        dtype_bytes = engine.resolved.dtype.itemsize
        line = decode_line(engine.loaded.config, plan, batch, window, dtype_bytes)
        emit("decode", {**line, "setup": engine_setup(engine), "machine": desc}, out)


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


# ---- vLLM ----------------------------------------------------------------------------------


def compare_vllm(
    python: str | None,
    folder: Path,
    dtype: torch.dtype,
    work: list[tuple[list[int], int]],
    desc: str,
    out: Path | None,
) -> float | None:
    """vLLM's tok/s on `work` (bench/vllm_peer.py), or None, with the reason printed, when it
    cannot run here."""
    python, reason = find_python(python)
    if python is None:
        print(f"offline system=vllm skipped reason={reason}", flush=True)
        return None
    longest = max(len(p) + n for p, n in work)
    job = OfflineJob(
        str(folder),
        dtype_name(dtype),
        torch.get_num_threads(),
        max(2048, longest),
        (WARM_UP_PROMPT, 2),
        work,
    )
    try:
        result = run_offline(python, job)
    except RuntimeError as exc:
        print(exc, file=sys.stderr, flush=True)
        first = str(exc).splitlines()[0]
        print(f"offline system=vllm skipped reason={first} (its output: stderr)", flush=True)
        return None
    asked = sum(n for _, n in work)
    if result.tokens != asked:
        print(f"# vllm produced {result.tokens} of {asked} tokens", file=sys.stderr, flush=True)
    setup = Setup(result.setup, result.setup_s)
    return report("vllm", len(work), result.tokens, result.seconds, setup, desc, out)


# ---- command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from shoal.config import EngineOptions

    defaults = EngineOptions()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64, help="0: no throughput runs")
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=PEERS,
        default=list(PEERS),
        help="systems measured against shoal on the same work (none: shoal alone)",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of an environment with vLLM (default: $SHOAL_BENCH_VLLM_PYTHON, else "
        "this one if it imports vllm; none: vllm is skipped)",
    )
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-batch",
        type=int,
        nargs="+",
        default=[8, 16, 32],
        help="batch sizes for batched generate, each measured (0 skips)",
    )
    parser.add_argument(
        "--hf-solo",
        type=int,
        default=8,
        help="requests run one at a time through generate (0 skips)",
    )
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="both systems (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument(
        "--quantization", default=None, choices=["int8"], help="shoal's weights (CPU; default none)"
    )
    parser.add_argument("--max-running", type=int, default=defaults.max_running_requests)
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=defaults.kv_cache_tokens,
        help="shoal's KV pool (unset: 32768 on the CPU, on CUDA sized from free GPU memory)",
    )
    parser.add_argument("--chunk-size", type=int, default=defaults.chunk_size)
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens)
    parser.add_argument(
        "--max-mixed-prefill-tokens",
        type=int,
        default=0,
        help="prompt tokens a step that also decodes may take (default 0: no cap beside "
        "--max-batch-tokens; the engine's default on the CPU, 64, steadies streamed tokens, "
        "which an offline run has none of; as vLLM's LLM class takes a larger token budget "
        "than its server)",
    )
    parser.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=defaults.cuda_graph_max_batch,
        help="decode batches up to this size replay CUDA graphs (capped by --max-running)",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="cuda_graph_max_batch=0")
    parser.add_argument("--no-overlap", action="store_true", help="max_inflight=1")
    parser.add_argument(
        "--pipeline-stages",
        "--pp",
        type=int,
        default=1,
        help="the model's layers split across this many executor stages (shoal only)",
    )
    parser.add_argument(
        "--decode-batch",
        type=int,
        nargs="+",
        default=[],
        help="decode step time at these batch sizes (each <= --max-running)",
    )
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-output-len", type=int, default=64)
    parser.add_argument(
        "--hbm-gbps",
        type=float,
        default=None,
        help="peak memory bandwidth for the roofline (default: by GPU name; CPU: none)",
    )
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--smoke", action="store_true", help="4 requests of 4-8 + 2-4 tokens")
    parser.add_argument(
        "--window-pages",
        type=int,
        default=0,
        metavar="N",
        help="then one N-token generation, its pages sampled (bench/window_pages.py)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt_len, args.output_len = 4, (4, 8), (2, 4)
        args.hf_batch, args.hf_solo = [2], 1
    if args.decode_batch:
        largest = max(args.decode_batch)
        if min(args.decode_batch) < 1 or largest > args.max_running:
            parser.error(f"--decode-batch sizes must be 1 .. --max-running ({args.max_running})")
        if args.decode_output_len < 2:
            parser.error("--decode-output-len must be >= 2 (a first token, then decode steps)")
        page = defaults.page_size
        pages = -(-(args.decode_prompt_len + args.decode_output_len) // page)
        if args.kv_cache_tokens is not None and largest * pages * page > args.kv_cache_tokens:
            parser.error(
                f"--decode-batch {largest} needs --kv-cache-tokens >= {largest * pages * page}"
            )
    return args


def model_argument(model: str | None) -> str | None:
    """`tiny:<family>` builds a tiny random model of that family (tests/tiny_families.py) in a
    temporary folder, for a smoke run of a family without its checkpoint; else `model` as is."""
    if model is None or not model.startswith("tiny:"):
        return model
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_families import FAMILIES, make_family_folder

    family = model.removeprefix("tiny:")
    if family not in FAMILIES:
        raise SystemExit(f"--model tiny:<family>: one of {', '.join(sorted(FAMILIES))}")
    return str(make_family_folder(Path(tempfile.mkdtemp()) / family, family))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shoal.config import EngineOptions, resolve_device
    from shoal.models.load import load_model

    options: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "attention": args.attention,
        "quantization": args.quantization,
        "max_running_requests": args.max_running,
        "kv_cache_tokens": args.kv_cache_tokens,
        "chunk_size": args.chunk_size,
        "max_batch_tokens": args.max_batch_tokens,
        "max_mixed_prefill_tokens": args.max_mixed_prefill_tokens,
        "cuda_graph_max_batch": 0 if args.no_cuda_graphs else args.cuda_graph_max_batch,
        "max_inflight": 1 if args.no_overlap else EngineOptions().max_inflight,
        "pipeline_stages": args.pipeline_stages,
    }
    device, dtype = resolve_device(EngineOptions(**options))
    hbm_gbps = args.hbm_gbps
    if hbm_gbps is None and device.type == "cuda":
        hbm_gbps = hbm_gbps_for(torch.cuda.get_device_name(device))
    plan = DecodePlan(
        args.decode_batch, args.decode_prompt_len, args.decode_output_len, hbm_gbps, args.seed
    )
    desc = machine()

    began = time.perf_counter()
    loaded = load_model(model_argument(args.model), dtype=dtype)
    load_s = time.perf_counter() - began
    work = workload(
        args.requests, loaded.config.vocab_size, args.seed, args.prompt_len, args.output_len
    )
    shoal = asyncio.run(
        run_engine(loaded, load_s, options, work, plan, desc, args.out, args.window_pages)
    )
    if shoal is None:
        return 0
    gc.collect()  # the closed engine's KV pool and graphs, before a peer loads on the device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ratios: dict[str, float] = {}
    if "vllm" in args.peers:
        vllm = compare_vllm(args.vllm_python, loaded.path, dtype, work, desc, args.out)
        if vllm is not None:
            ratios["shoal_over_vllm"] = shoal / vllm
    batches = [b for b in args.hf_batch if b > 0]
    if "hf" in args.peers and (batches or args.hf_solo):
        solo = min(args.hf_solo, len(work))
        batched, one_at_a_time = compare_hf(
            loaded, work, batches, solo, device, dtype, desc, args.out
        )
        if batched:
            ratios["shoal_over_hf_batch"] = shoal / max(batched)
        if one_at_a_time is not None:
            ratios["shoal_over_hf_solo"] = shoal / one_at_a_time
    if not ratios:
        return 0
    fields = " ".join(f"{k}={v:.2f}" for k, v in ratios.items())
    print(f"offline summary {fields} machine={desc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
