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
           weight_mb=<x> kv_mb=<x> [spec_steps=<n> spec_drafted=<n> spec_accepted=<n>]
           setup=<desc> machine=<desc>
(with --speculative-algorithm, step_ms is a token's time and the spec_ counts cover both of a
batch size's runs, the untimed one too);
setup: shoal's <device>-<dtype>-<attention>-graphs<max batch, 0 off>-inflight<n>-<linear>:<how>
[-kv<dtype>][-stages<n>][-ngram<k>], as the engine resolved them (dtype: the activations';
linear: dense, packed, bf16 or int8 weights, and how they multiply, e.g. bf16:onednn-amx,
packed:panels-avx512_vnni, int8:blocks-avx2; kv: the KV cache's dtype where it is not the
activations'); machine: the CPU's model and features first; vLLM's
<device>-<dtype>-vllm<version>; generate's <device>-<dtype>-hf.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import offline_args
import torch
from bench_format import machine, workload
from hf_peer import compare_hf
from offline_shoal import run_engine
from offline_vllm import compare_vllm
from roofline import DecodePlan, hbm_gbps_for


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return offline_args.parse_args(argv, __doc__)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shoal.config import EngineOptions
    from shoal.models.load import load_model
    from shoal.resolve_options import resolve_device

    options: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
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
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
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
    # in a thread that ends with the load: an OpenMP team left on this thread would make every
    # barrier of the CPU forward sleep (api/fresh_thread.py)
    with ThreadPoolExecutor(1) as loader:
        loaded = loader.submit(
            load_model, offline_args.model_argument(args.model), dtype=dtype
        ).result()
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
