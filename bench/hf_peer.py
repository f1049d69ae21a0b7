"""transformers `generate` as an offline peer: left-padded batches of a fixed size, or one
request at a time, each credited only with the tokens its requests asked for."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from bench_format import WARM_UP_PROMPT, Setup, dtype_name, report, sync
from tqdm import tqdm


def run_hf(
    model: Any, work: list[tuple[list[int], int]], batch_size: int, device: torch.device
) -> tuple[int, float]:
    tokens = 0
    sync(device)
    began = time.perf_counter()
    starts = range(0, len(work), batch_size)
    for start in tqdm(starts, desc=f"generate x{batch_size}", disable=len(work) < 8):
        chunk = work[start : start + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device
        )
        max_new = max(m for _, m in chunk)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        tokens += sum(m for _, m in chunk)  # tokens each request asked for (the rest is waste)
    sync(device)
    return tokens, time.perf_counter() - began


def compare_hf(
    loaded: Any,
    work: list[tuple[list[int], int]],
    batches: list[int],
    solo: int,
    device: torch.device,
    dtype: torch.dtype,
    desc: str,
    out: Path | None,
) -> tuple[list[float], float | None]:
    """generate's tok/s at each batch size, and one at a time (None if not asked for)."""
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    model: Any = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype)
    model = model.to(device).eval()
    setup = Setup(f"{device.type}-{dtype_name(dtype)}-hf", time.perf_counter() - began)
    run_hf(model, [(WARM_UP_PROMPT, 2)], 1, device)  # CUDA context, kernels, allocator
    batched = []
    for size in batches:
        tokens, seconds = run_hf(model, work, size, device)
        name = f"hf-generate-batch{size}"
        batched.append(report(name, len(work), tokens, seconds, setup, desc, out))
    one_at_a_time = None
    if solo:
        tokens, seconds = run_hf(model, work[:solo], 1, device)
        one_at_a_time = report("hf-generate-solo", solo, tokens, seconds, setup, desc, out)
    return batched, one_at_a_time
