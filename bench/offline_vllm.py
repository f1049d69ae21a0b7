"""vLLM's `LLM.generate` as bench/offline.py's peer: the same work as one job for
bench/vllm_peer.py's worker in vLLM's own environment, reported as an `offline system=vllm`
line, or skipped with the reason when it cannot run here."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from bench_format import WARM_UP_PROMPT, Setup, dtype_name, report
from vllm_peer import OfflineJob, find_python, run_offline


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
