"""The host's cost of a decode step, by batch size, with the device work taken out.

    python bench/host_cost.py                                # both paths, greedy and sampled
    python bench/host_cost.py --paths cpu --sampling greedy --batches 1 64 256
    python bench/host_cost.py --device-ms 5 --batches 256    # how busy a 5 ms device would be
    python bench/host_cost.py --smoke                        # seconds: the test's run

A real Engine (actors, mailboxes, threads) serves B requests on a tiny random Llama
(host_cost_model.py; `--model` takes any folder) whose forward is a table lookup
(host_cost_fake.py), so what the clocks see is shoal's host code: scheduler, cache manager,
tokenizer actor (detokenizing, stream pushes), the callers' stream readers, the executor's
launch thread (table writes, inputs, sampling) and completion thread. Each window is `--steps`
decode steps of all B requests, prefill excluded (host_cost_window.py says what each thread's
clock counts).

Paths (`--paths`):
- cpu: the engine on the CPU as it runs there (attention "auto": the compiled kernels' metadata
  when they build); the forward runs on the launch thread.
- graph: the CUDA-graph path's host code. Without CUDA the decode graphs are set up without
  capturing (actors/executor/cuda_graphs.py's CPU mode; attention "triton", which the trivial
  forward never calls, so TRITON_INTERPRET=1 is set only to let the engine start) and each
  "replay" is a call of the trivial forward. With CUDA the trivial forward is captured into
  real graphs and replayed.

`--device-ms N` gives each forward N ms of device time (host_cost_fake.FakeDevice: a sleep on
the launch thread for the cpu path, a queued virtual step waited for at the result copy for
the graph path) and reports device_busy = device time / wall time in the window.

One line per window, then one fit per (path, sampling, device_ms): the CPU time per step
against B by least squares, `fixed_ms + us_per_seq * B / 1000`, all threads (total) and per
thread:

    host_cost path=<cpu|graph> sampling=<greedy|sampled> batch=<B> device_ms=<N> steps=<K>
        step_ms=<wall> cpu_ms=<total> total_us_per_seq=<x> loop_us_per_seq=<x>
        launch_us_per_seq=<x> completion_us_per_seq=<x> other_us_per_seq=<x> forward_us=<x>
        device_busy=<0..1> setup=<desc> machine=<desc>
    host_cost_fit path=.. sampling=.. device_ms=.. batches=<b,..> fixed_ms=<x> us_per_seq=<x>
        loop_fixed_ms=.. loop_us_per_seq=.. (launch_, completion_, other_ alike) machine=..

The figures are CPU time, not wall time, so a busy machine moves them less than it moves
step_ms; still, compare only lines of one run, or runs interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_format import dtype_name, emit, machine
from host_cost_fake import FakeDevice, StepCounter, TrivialForward, clean_ids, installed
from host_cost_model import tiny_llama_folder
from host_cost_window import PROMPT_TOKENS, SLACK_TOKENS, Window, measure

ROLES = ("loop", "launch", "completion", "other")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny one)")
    parser.add_argument("--paths", nargs="+", default=["cpu", "graph"], choices=["cpu", "graph"])
    parser.add_argument(
        "--sampling", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=200, help="decode steps a window")
    parser.add_argument("--warm-tokens", type=int, default=4, help="tokens each before a window")
    parser.add_argument("--repeat", type=int, default=1, help="windows a batch size")
    parser.add_argument("--device-ms", type=float, default=0.0, help="fake device ms a step")
    parser.add_argument("--max-inflight", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--smoke", action="store_true", help="batches 1 and 4, 8 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.steps = [1, 4], 8
    return args


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares y = a + b x over (x, y); (mean y, 0) when every x is the same."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - slope * mean_x, slope


def window_line(path: str, sampling: str, device_ms: float, w: Window) -> dict[str, Any]:
    b = w.batch
    line: dict[str, Any] = {"path": path, "sampling": sampling, "batch": b}
    line |= {"device_ms": device_ms, "steps": w.steps, "step_ms": round(w.step_ms, 4)}
    line |= {"cpu_ms": round(w.cpu_us["total"] / 1e3, 4)}
    line |= {f"{k}_us_per_seq": round(w.cpu_us[k] / b, 2) for k in ("total", *ROLES)}
    return line | {
        "forward_us": round(w.cpu_us["forward"], 2),
        "device_busy": round(w.device_busy, 3),
    }


def fit_line(path: str, sampling: str, device_ms: float, windows: list[Window]) -> dict[str, Any]:
    batches = sorted({w.batch for w in windows})
    line: dict[str, Any] = {"path": path, "sampling": sampling, "device_ms": device_ms}
    line["batches"] = ",".join(str(b) for b in batches)
    for role in ("total", *ROLES):
        fixed_us, per_seq = fit([(w.batch, w.cpu_us[role]) for w in windows])
        prefix = "" if role == "total" else f"{role}_"
        line |= {
            f"{prefix}fixed_ms": round(fixed_us / 1e3, 4),
            f"{prefix}us_per_seq": round(per_seq, 2),
        }
    return line


def engine_options(path: str, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    max_batch = max(args.batches)
    page = 16
    per_request = PROMPT_TOKENS + args.warm_tokens + args.steps + SLACK_TOKENS + 2 * page
    options: dict[str, Any] = {
        "device": "cuda" if cuda else "cpu",
        "max_running_requests": max_batch,
        "kv_cache_tokens": max_batch * per_request + 4 * page,
        "max_mixed_prefill_tokens": 0,  # admit all B at once: the window starts sooner
        "max_inflight": args.max_inflight,
        "num_threads": args.threads,
        "seed": args.seed,
        "page_size": page,
        "cuda_graph_max_batch": max_batch if path == "graph" else 0,
    }
    if path == "graph":
        options["attention"] = "triton"
    return options


async def run_path(path: str, loaded: Any, args: argparse.Namespace, desc: str) -> None:
    from shoal import Engine

    cuda = path == "graph" and torch.cuda.is_available()
    if path == "graph" and not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # lets attention "triton" start; never runs
    device = torch.device("cuda" if cuda else "cpu")
    mode = "sync" if path == "cpu" else "cuda" if cuda else "async"
    vocab = loaded.config.vocab_size
    clean = clean_ids(loaded.tokenizer, vocab)
    forward = TrivialForward(
        clean, vocab, args.seed, FakeDevice(args.device_ms, mode, device), device
    )
    counter = StepCounter()
    context = loaded.config.max_position_embeddings
    graphs = (max(args.batches), context) if path == "graph" and not cuda else None
    with installed(forward, counter, graphs):
        async with Engine(loaded, **engine_options(path, args, cuda)) as engine:
            r = engine.resolved
            assert r is not None
            graph_size = max(args.batches) if path == "graph" else 0
            setup = f"{r.device.type}-{dtype_name(r.dtype)}-{engine.attention}"
            setup += f"-graphs{graph_size}-inflight{args.max_inflight}"
            for sampling in args.sampling:  # untimed: first calls, lazy imports
                await measure(
                    engine, forward, counter, min(args.batches), 8, sampling, 2, args.seed, clean
                )
            for sampling in args.sampling:
                windows = []
                for batch in args.batches:
                    for _ in range(args.repeat):
                        w = await measure(
                            engine, forward, counter, batch, args.steps, sampling,
                            args.warm_tokens, args.seed, clean,
                        )  # fmt: skip
                        windows.append(w)
                        line = window_line(path, sampling, args.device_ms, w)
                        emit("host_cost", line | {"setup": setup, "machine": desc}, args.out)
                if len({w.batch for w in windows}) > 1:  # a line needs two batch sizes
                    fitted = fit_line(path, sampling, args.device_ms, windows)
                    emit("host_cost_fit", fitted | {"machine": desc}, args.out)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    from shoal.models.load import load_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tiny_llama_folder(Path(tmp) / "tiny", args.seed)
        loaded = load_model(folder, progress=False)
        desc = machine()
        for path in args.paths:
            asyncio.run(run_path(path, loaded, args, desc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
