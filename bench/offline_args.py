"""bench/offline.py's command line: its options, what --smoke sets, the checks of
--decode-batch, and `--model tiny:<family>` (a tiny random model of a family, built for a
smoke run without its checkpoint)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PEERS = ("vllm", "hf")


def parse_args(argv: list[str] | None, description: str | None) -> argparse.Namespace:
    """bench/offline.py's options (`description`: its --help text), --smoke's values filled
    in and --decode-batch checked against --max-running and --kv-cache-tokens."""
    from shoal.config import EngineOptions

    defaults = EngineOptions()
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
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
        "--max-batch-tokens; the engine's default on the CPU, measured at start, steadies streamed "
        "tokens, which an offline run has none of; as vLLM's LLM class takes a larger token budget "
        "than its server)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="shoal's KV cache (auto: the weights' dtype: bfloat16 with bfloat16 weights)",
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
        "--speculative-algorithm",
        default=None,
        choices=["ngram"],
        help="shoal's speculative decoding (default off); a decode line's step_ms is then a "
        "token's time, and the line counts the drafts verified and kept",
    )
    parser.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=defaults.speculative_num_draft_tokens,
        help="the drafts a speculating row may send (with --speculative-algorithm)",
    )
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
    """`tiny:<family>` builds a tiny random model of that family
    (tests/support/tiny_families.py) in a temporary folder, for a smoke run of a family without
    its checkpoint; else `model` as is."""
    if model is None or not model.startswith("tiny:"):
        return model
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
    from tiny_families import FAMILIES, make_family_folder

    family = model.removeprefix("tiny:")
    if family not in FAMILIES:
        raise SystemExit(f"--model tiny:<family>: one of {', '.join(sorted(FAMILIES))}")
    return str(make_family_folder(Path(tempfile.mkdtemp()) / family, family))
