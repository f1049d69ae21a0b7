"""A decode step's time, measured from outside the engine, against its HBM-bandwidth roofline.

The roofline is the time a decode step of B sequences needs just to read, once, the bytes it
cannot avoid reading from GPU memory, at the memory's peak bandwidth:

    roofline_s = (weight_bytes + kv_bytes) / (hbm_gbps * 1e9)        (GB/s as vendors count:
                                                                      10^9 bytes)
    weight_bytes = dtype_bytes * (
          num_layers * ( hidden * q_dim                  q_proj     q_dim  = num_heads * head_dim
                       + 2 * hidden * kv_dim             k, v_proj  kv_dim = num_kv_heads * head_dim
                       + q_dim * hidden                  o_proj
                       + (q_dim + 2 * kv_dim)            q/k/v biases, only if attention_bias
                       + 3 * hidden * intermediate       gate, up, down_proj
                       + 2 * hidden )                    the two RMSNorm weights
        + hidden                                         the final norm
        + B * hidden                                     embed_tokens: only the B rows looked up
        + vocab * hidden )                               lm_head: read whole, tied or not (tied,
                                                         it is embed_tokens read a second time)
    kv_bytes = dtype_bytes * B * context_tokens * num_layers * 2 * num_kv_heads * head_dim
                                                         K and V of every token each sequence
                                                         attends to, the new one included

Left out, so the bound stays a lower bound: activations, RoPE tables, the logits and the
sampling (a fused kernel need not write them out), and the new token's K/V write.

The measured step time (`decode_window`) comes from the per-token arrival times of B requests
started together, each with the same prompt length and the same number of output tokens
(ignore_eos). The window runs from the first token of the request that started last (when
every request has its first token, so every prompt is prefilled) to that request's last
token that arrived no later than the first request to finish: every step in it is a decode
step of all B sequences. Its context is that request's mean context over the window (prompt +
tokens so far); the other requests started no later, so their contexts are no shorter and
the KV term stays a lower bound.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.loading.config import ModelConfig

# Peak HBM bandwidth in GB/s by GPU name, from the vendors' data sheets. Each entry: the
# substrings torch.cuda.get_device_name() must all contain. "NVIDIA H100 80GB HBM3" is the SXM
# part; the PCIe part has HBM2e and names itself "NVIDIA H100 PCIe".
HBM_GBPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 4800.0),
    (("H100", "PCIe"), 2000.0),
    (("H100", "SXM"), 3350.0),
    (("H100", "HBM3"), 3350.0),
)


def hbm_gbps_for(gpu_name: str) -> float | None:
    """The peak bandwidth of a GPU the table knows, else None (pass --hbm-gbps)."""
    for parts, gbps in HBM_GBPS:
        if all(part in gpu_name for part in parts):
            return gbps
    return None


@dataclass(frozen=True)
class DecodeBytes:
    weights: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def decode_step_bytes(
    config: ModelConfig,
    batch_size: int,
    context_tokens: float,
    dtype_bytes: int,
    kv_bytes: int | None = None,
) -> DecodeBytes:
    """What one decode step of `batch_size` sequences must read at least (module doc): weights
    of `dtype_bytes` an element, the KV of `kv_bytes` (unset: the same)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    per_layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    per_layer += (q_dim + 2 * kv_dim) if config.attention_bias else 0
    per_layer += 3 * hidden * inter + 2 * hidden
    weights = config.num_layers * per_layer + hidden + batch_size * hidden
    weights += config.vocab_size * hidden
    kv_per_token = config.num_layers * 2 * kv_dim
    kv = round(batch_size * context_tokens * kv_per_token)
    return DecodeBytes(weights * dtype_bytes, kv * (dtype_bytes if kv_bytes is None else kv_bytes))


def roofline_s(num_bytes: int, hbm_gbps: float) -> float:
    return num_bytes / (hbm_gbps * 1e9)


@dataclass(frozen=True)
class DecodeWindow:
    steps: int  # decode steps of the whole batch inside the window
    seconds: float
    context_tokens: float  # the request that started last: its mean context over the window

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps


def decode_window(arrivals: Sequence[Sequence[float]], prompt_tokens: int) -> DecodeWindow:
    """The window in which all B requests decoded together (module doc).

    arrivals[r][i]: when request r's output token i (0: the one its prefill made) reached the
    caller. The step that made token i (i >= 1) attended to the prompt and tokens 0 .. i-1.
    """
    last_to_start = max(arrivals, key=lambda times: times[0])
    first_finish = min(times[-1] for times in arrivals)
    end = max((i for i, t in enumerate(last_to_start) if t <= first_finish), default=0)
    if end < 1:
        raise ValueError(
            "no decode step ran the whole batch: a request finished before the last one got "
            "its first token (too few output tokens, or too little KV cache for the batch)"
        )
    seconds = last_to_start[end] - last_to_start[0]
    return DecodeWindow(end, seconds, prompt_tokens + (end + 1) / 2)


# ---- measuring it --------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodePlan:
    batch_sizes: list[int]
    prompt_tokens: int  # every request's
    output_tokens: int  # every request's (ignore_eos)
    hbm_gbps: float | None  # None: the roofline is unknown
    seed: int


async def decode_arrivals(engine: Any, prompts: list[list[int]], output: int) -> list[list[float]]:
    """Start every prompt at once; for each, when each of its output tokens reached us."""

    async def arrivals(stream: Any) -> list[float]:
        times: list[float] = []
        async for delta in stream:
            now = time.perf_counter()
            times += [now] * len(delta.token_ids)
        if len(times) != output:
            raise RuntimeError(f"asked for {output} tokens with ignore_eos, got {len(times)}")
        return times

    streams = [
        engine.generate(input_ids=p, max_new_tokens=output, temperature=0.0, ignore_eos=True)
        for p in prompts
    ]
    return list(await asyncio.gather(*(arrivals(s) for s in streams)))


async def measure_decode(
    engine: Any, plan: DecodePlan, batch_size: int, rng: random.Random
) -> DecodeWindow:
    """The batch runs twice on fresh random prompts: untimed (a new batch shape compiles its
    kernels and picks its matmul algorithms there), then measured."""
    vocab = engine.loaded.config.vocab_size
    runs = [
        [[rng.randrange(100, vocab) for _ in range(plan.prompt_tokens)] for _ in range(batch_size)]
        for _ in range(2)
    ]
    await decode_arrivals(engine, runs[0], plan.output_tokens)
    arrivals = await decode_arrivals(engine, runs[1], plan.output_tokens)
    return decode_window(arrivals, plan.prompt_tokens)


def decode_line(
    config: ModelConfig,
    plan: DecodePlan,
    batch_size: int,
    window: DecodeWindow,
    dtype_bytes: int,
    kv_bytes: int | None = None,
) -> dict[str, Any]:
    """The decode line's fields up to kv_mb; roofline and fraction "unknown" without a
    bandwidth. fraction_of_roofline = roofline_ms / step_ms (1.0: at the bound)."""
    need = decode_step_bytes(config, batch_size, window.context_tokens, dtype_bytes, kv_bytes)
    step_ms = window.step_s * 1e3
    roofline_ms: float | str = "unknown"
    fraction: float | str = "unknown"
    if plan.hbm_gbps is not None:
        bound_ms = roofline_s(need.total, plan.hbm_gbps) * 1e3
        roofline_ms, fraction = round(bound_ms, 4), round(bound_ms / step_ms, 3)
    return {
        "batch": batch_size,
        "prompt_tokens": plan.prompt_tokens,
        "output_tokens": plan.output_tokens,
        "steps": window.steps,
        "context_tokens": window.context_tokens,
        "step_ms": round(step_ms, 4),
        "roofline_ms": roofline_ms,
        "fraction_of_roofline": fraction,
        "hbm_gbps": plan.hbm_gbps if plan.hbm_gbps is not None else "unknown",
        "weight_mb": round(need.weights / 1e6, 3),
        "kv_mb": round(need.kv_cache / 1e6, 3),
    }
