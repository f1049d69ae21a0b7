"""bench/serving.py's metrics line from one run's results, SGLang's bench_serving definitions:
TTFT, the time to the first non-empty chunk; ITL, the gaps between consecutive non-empty
chunks, pooled over requests; TPOT per request, (latency - TTFT) / (output tokens - 1); E2E,
the request's latency; each as mean, median and p99 in milliseconds."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from bench_format import machine
from serving_requests import Result


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000 if len(values_s) else np.zeros(1)
    return {
        f"{name}_ms_mean": round(float(ms.mean()), 2),
        f"{name}_ms_median": round(float(np.median(ms)), 2),
        f"{name}_ms_p99": round(float(np.percentile(ms, 99)), 2),
    }


def summarize(
    system: str, mode: str, load: float, results: list[Result], seconds: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    line: dict[str, Any] = {
        "system": system,
        "mode": mode,
        "load": load,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "req_per_s": round(len(ok) / seconds, 3),
        "out_tok_per_s": round(tokens / seconds, 2),
    }
    line |= _stats("ttft", [r.ttft_s for r in ok])
    line |= _stats("itl", [gap for r in ok for gap in r.itl_s])
    line |= _stats("tpot", tpot)
    line |= _stats("e2e", [r.latency_s for r in ok])
    line["machine"] = machine()
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        print(f"serving {system} errors: {errors[:3]}", file=sys.stderr)
    return line
