"""Online serving: a load generator against OpenAI-compatible servers over HTTP streaming
`/v1/completions`, at a fixed concurrency or with Poisson arrivals at a rate.

    python bench/serving.py                           # shoal, llama.cpp and vLLM, c = 1 4 16
    python bench/serving.py --launch shoal --concurrency 1 4 16 64
    python bench/serving.py --launch shoal --quantization int8 --shoal-args "--chunk-size 256"
    python bench/serving.py --launch vllm --vllm-python /path/to/vllm-env/bin/python
    python bench/serving.py --base-url http://127.0.0.1:30000 --rate 2 8
    python bench/serving.py --launch shoal --model <folder> --smoke

`--launch` starts each system as a subprocess on the same model (shoal on the folder or GGUF,
llama-cpp-python's server on the GGUF file, vLLM's OpenAI server on the HF folder, from its
own environment: --vllm-python, bench/vllm_peer.py) with the same thread count, one at a
time (bench/launch.py); a system that is not installed is skipped with the reason. Prompts
are seeded random words (text, so any server takes them), the same for every system and run.
shoal and vLLM get `ignore_eos` (vLLM also `min_tokens`); llama.cpp, which has no such field,
gets the end-of-sequence ids banned with `logit_bias` and `min_tokens`. Output tokens: the
usage chunk where the server sends one (shoal, vLLM), else max_tokens for a request that
finished with "length", else the chunks received.

Metrics (SGLang's bench_serving definitions): TTFT, the time to the first non-empty chunk;
ITL, the gaps between consecutive non-empty chunks, pooled over requests; TPOT per request,
(latency - TTFT) / (output tokens - 1); E2E, the request's latency. One line per run:
    serving system=<s> mode=<concurrency|rate> load=<x> requests=<n> failed=<n>
            output_tokens=<n> seconds=<s> req_per_s=<x> out_tok_per_s=<x>
            ttft_ms_{mean,median,p99}=<x> itl_ms_{...} tpot_ms_{...} e2e_ms_{...} machine=<desc>
A launched shoal with --quantization / --shoal-args is named by them: system=shoal-int8,
system=shoal_--chunk-size_256 (launch.py's LaunchConfig.label). A system that cannot start:
    serving system=<s> skipped: <why>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path

from launch import SYSTEMS, LaunchConfig, eos_ids_of, launch, missing
from serving_load import run_load
from serving_requests import Request, workload


async def amain(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--launch", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    target.add_argument("--base-url", default=None, help="an already running server")
    parser.add_argument("--system", default="shoal", help="with --base-url: shoal|llamacpp|...")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 (GGUF)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quantization", default=None, choices=["int8"], help="shoal's weights (default none)"
    )
    parser.add_argument(
        "--shoal-args",
        default="",
        help='more `python -m shoal serve` arguments, e.g. "--chunk-size 256"',
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of an environment with vLLM (default: $SHOAL_BENCH_VLLM_PYTHON, else "
        "this one if it imports vllm)",
    )
    parser.add_argument(
        "--vllm-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="vLLM's dtype (bfloat16: its default on a CPU with bfloat16; lines say vllm-bfloat16)",
    )
    parser.add_argument(
        "--llamacpp-python",
        default=None,
        help="python of an environment with llama-cpp-python (default: "
        "$SHOAL_BENCH_LLAMACPP_PYTHON, else this one)",
    )
    loads = parser.add_mutually_exclusive_group()
    loads.add_argument("--concurrency", type=int, nargs="+", default=None)
    loads.add_argument("--rate", type=float, nargs="+", default=None, help="requests/s")
    parser.add_argument("--requests", type=int, default=0, help="per run (0: max(8, 2 x c))")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 192), help="words")
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 96), help="tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="c = 1 2, 4 requests, short")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests = [1, 2], 4
        args.prompt_len, args.output_len = (4, 12), (2, 6)
    mode = "rate" if args.rate else "concurrency"
    levels: list[float] = args.rate or args.concurrency or [1, 4, 16]

    def sized(level: float) -> list[Request]:
        n = args.requests or max(8, 2 * int(level))
        return workload(n, args.seed, args.prompt_len, args.output_len)

    async def runs(system: str, label: str, base_url: str) -> None:
        eos_ids = eos_ids_of(args.model) if system == "llamacpp" else []
        for level in levels:
            line = await run_load(
                base_url,
                system,
                sized(level),
                mode,
                level,
                args.seed,
                eos_ids,
                not args.no_progress,
            )
            line["system"] = label
            print("serving " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(line) + "\n")

    if args.base_url is not None:
        await runs(args.system, args.system, args.base_url.rstrip("/"))
        return 0
    config = LaunchConfig(
        args.model,
        args.threads,
        args.quantization,
        tuple(shlex.split(args.shoal_args)),
        args.vllm_python,
        args.vllm_dtype,
        args.llamacpp_python,
    )
    for system in args.launch:
        reason = missing(system, config)
        if reason is not None:
            print(f"serving system={system} skipped: {reason}", flush=True)
            continue
        async with launch(system, config) as server:
            print(f"# {system} ready at {server.base_url} in {server.startup_s:.1f}s", flush=True)
            for said in server.log:  # the kernels and the cap shoal picked (its serve log)
                if said.startswith(("shoal kernels:", "shoal scheduling:")):
                    print(f"# {said}", flush=True)
            await runs(system, config.label(system), server.base_url)
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(argv))


if __name__ == "__main__":
    sys.exit(main())
