"""The user's options (config.py) resolved once at start into narrow sections: the cache's
layout, the device and dtype, the attention backend, CUDA graphs, the linear kind, the mixed
prefill cap and the KV's dtype (`Resolved`); each actor gets only its own part."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace

import torch

from shoal.config import DTYPES, EngineOptions
from shoal.kernels.cpu_features import bf16_by_default, kernel_report, read_cpu_features
from shoal.kernels.linear import LinearKind, packing_available
from shoal.memory import DeviceMemory, kv_cache_tokens

# A CPU step's time grows with every prompt token it carries (about 1.1 ms each for SmolLM2 on
# the 2-core VM), so a cap keeps running streams steady; 64 halved 128's inter-token p99 at
# 16 streams for the same throughput (docs/cpu-step.md, "Scheduling for latency"). A GPU step
# barely notices a chunk, and no cap is what SGLang and vLLM do there.
CPU_MIXED_PREFILL_TOKENS = 64
# Unset on the CPU, the cap is measured at start instead (api/startup.py): as many prompt tokens
# as the model's matmuls compute in CPU_CHUNK_MS (models/prompt_cost.py), in steps of 32, from
# 64 (32 cost 5% of the throughput and doubled the median inter-token gap on the AVX2 EPYC, at
# ~1 ms a token) to 256. On the Zen 5 EPYC SmolLM2's matmuls measured 0.25-0.30 ms a token in
# bfloat16: 128 (once 160), which kept the median TTFT at 16 streams below vLLM's where 64 did
# not (bench/README.md); 0.45-0.49 in float32: 64.
CPU_CHUNK_MS = 40.0
CPU_CAP_STEP = 32
CPU_CAP_MAX = 256


@dataclass(frozen=True)
class CacheLayout:
    page_size: int
    num_pages: int
    num_rows: int
    max_pages_per_row: int


@dataclass(frozen=True)
class Resolved:
    """Derived once at start; each actor gets only its own part."""

    cache: CacheLayout
    context_length: int
    dtype: torch.dtype  # the activations'
    device: torch.device
    attention: str  # "torch" | "triton" | "cpu"
    cuda_graph_max_batch: int  # 0 = no graphs (always 0 off CUDA or without Triton)
    linear_kind: LinearKind  # how the forward multiplies by weights (kernels/linear.py)
    mixed_prefill_tokens: int  # prompt tokens a step that also decodes may take; 0: no cap
    kv_dtype: torch.dtype  # the KV cache's elements
    # the cap is the CPU's, unset: the start measures a prompt token (actors/device_build.py)
    # and replaces mixed_prefill_tokens, the fallback until then (with_measured_cap)
    cap_to_measure: bool = False
    # a prompt token's matmuls as the start measured them, where it picked the cap (None: not)
    prompt_token_ms: float | None = None
    # from how many rows float32's panels give way to oneDNN, as the start measured it
    # (kernels/f32_many_rows.py; None: not float32 panels; NEVER: never)
    f32_many_rows: int | None = None

    def with_measured_cap(self, prompt_token_ms: float) -> Resolved:
        """The CPU's mixed-prefill cap for a prompt token that costs this (api/startup.py)."""
        cap = measured_mixed_prefill(prompt_token_ms)
        return replace(
            self, mixed_prefill_tokens=cap, cap_to_measure=False, prompt_token_ms=prompt_token_ms
        )

    def start_report(self, attention: str) -> str:
        """What the start picked, as serve logs it, a line each: `shoal kernels: ...`
        (kernels/cpu_features.py: kernel_report; `attention`: the backend in use) and
        `shoal scheduling: ...`."""
        kernels = kernel_report(
            self.device,
            self.linear_kind,
            attention,
            kv_dtype=self.kv_dtype,
            f32_many_rows=self.f32_many_rows,
        )
        return f"shoal kernels: {kernels}\nshoal scheduling: {self.scheduling_report()}"

    def scheduling_report(self) -> str:
        """The cap as the serve log gives it: `mixed_prefill_cap=128 (a prompt token's matmuls
        measured at 0.30 ms)` where the start picked it, else `mixed_prefill_cap=64` or
        `mixed_prefill_cap=none`."""
        said = f"mixed_prefill_cap={self.mixed_prefill_tokens or 'none'}"
        if self.prompt_token_ms is None:
            return said
        return f"{said} (a prompt token's matmuls measured at {self.prompt_token_ms:.2f} ms)"


def resolve(
    options: EngineOptions,
    model_context: int,
    memory: DeviceMemory | None = None,
    has_experts: bool = False,
) -> Resolved:
    """`memory`: what sizes the KV pool when kv_cache_tokens is unset on CUDA (memory.py).
    `has_experts`: a mixture-of-experts model, whose routing picks on the host the experts a
    step runs (kernels/moe.py), so no graph can hold its decode; nor can one hold the forward
    split over pipeline stages."""
    options.validate()
    page_size = options.page_size
    num_pages = -(-kv_cache_tokens(options, model_context, memory) // page_size)
    context = min(options.context_length or model_context, model_context)
    # One request alone must always fit, or it could wait forever.
    context = min(context, (num_pages - 1) * page_size)
    if context < 2:
        raise ValueError("kv_cache_tokens is too small for even one request")
    device, weights_dtype = resolve_device(options)
    linear = resolve_linear(options, device, weights_dtype)
    # bfloat16 weights on the CPU: the activations stay float32 (bf16_linear.py)
    dtype = torch.float32 if linear == "bf16" else weights_dtype
    kv_dtype = resolve_kv_dtype(options, device, weights_dtype)
    attention = resolve_attention(options, device, dtype)
    graphs = 0
    one_forward = not has_experts and options.pipeline_stages == 1
    if device.type == "cuda" and attention == "triton" and one_forward:
        entries = options.max_running_requests  # a decode batch's, one a row ...
        if options.speculative_algorithm is not None:  # ... or one a draft's position
            drafting = min(options.speculative_max_running, options.max_running_requests)
            entries = max(entries, drafting * (1 + options.speculative_num_draft_tokens))
        graphs = min(options.cuda_graph_max_batch, entries)
    max_pages_per_row = -(-context // page_size) + 1
    layout = CacheLayout(page_size, num_pages, options.max_running_requests, max_pages_per_row)
    mixed = options.max_mixed_prefill_tokens
    to_measure = mixed is None and device.type == "cpu"
    if mixed is None:
        mixed = CPU_MIXED_PREFILL_TOKENS if to_measure else 0
    return Resolved(
        layout, context, dtype, device, attention, graphs, linear, mixed, kv_dtype, to_measure
    )


def resolve_kv_dtype(
    options: EngineOptions, device: torch.device, weights_dtype: torch.dtype
) -> torch.dtype:
    """auto: the weights' dtype; int8's: bfloat16 where the CPU takes bfloat16 weights by
    default (AMX or AVX512-BF16: half what decode attention reads, the same quality bounds
    held, bench/README.md), else float32. The CPU's kernels read either float32 or bfloat16
    (widened as they read); CUDA's Triton kernels and graphs keep the model's."""
    if options.kv_cache_dtype == "auto":
        if options.quantization == "int8" and bf16_by_default(read_cpu_features()):
            return torch.bfloat16
        return weights_dtype
    asked = DTYPES[options.kv_cache_dtype]
    if device.type == "cuda" and asked != weights_dtype:
        raise ValueError(
            f"kv_cache_dtype {options.kv_cache_dtype} on CUDA must be the weights' dtype "
            f"({str(weights_dtype).removeprefix('torch.')}): give auto"
        )
    return asked


def resolve_linear(options: EngineOptions, device: torch.device, dtype: torch.dtype) -> LinearKind:
    """int8 when asked for (CPU only); else bfloat16 weights on the CPU when its dtype is
    bfloat16; packed float32 on the CPU; else dense."""
    if options.quantization == "int8":
        if device.type != "cpu":
            raise ValueError("quantization int8 runs on the CPU only")
        return "int8"
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "bf16"
    return "packed" if packing_available(device, dtype) else "dense"


def resolve_device(options: EngineOptions) -> tuple[torch.device, torch.dtype]:
    """The device (auto: CUDA when available) and the weights' dtype (auto: bf16 on CUDA and
    on a CPU with AMX or AVX512-BF16)."""
    name = options.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    dtype_name = options.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if name == "cuda" or cpu_takes_bf16(options) else "float32"
    return torch.device(name), DTYPES[dtype_name]


def cpu_takes_bf16(options: EngineOptions) -> bool:
    """dtype auto on the CPU: bfloat16 weights where the CPU has the matrix units for them
    (kernels/cpu_features.py), unless int8 was asked for (its own weights, float32 around)."""
    return options.quantization is None and bf16_by_default(read_cpu_features())


def resolve_attention(options: EngineOptions, device: torch.device, dtype: torch.dtype) -> str:
    """auto: the Triton kernels on CUDA (when triton is installed; torch's CUDA wheels bring
    it); on the CPU in float32 the compiled kernels ("cpu", kernels/cpu_kernels.py;
    built on first use, and the torch reference if it cannot be built); else the torch
    reference. Triton on CPU runs only under its interpreter (TRITON_INTERPRET=1: correct and
    slow, for tests)."""
    has_triton = importlib.util.find_spec("triton") is not None
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    choice = options.attention
    if choice == "auto":
        if device.type == "cuda" and has_triton:
            choice = "triton"
        else:
            choice = "cpu" if cpu_float32 else "torch"
    if choice == "cpu" and not cpu_float32:
        raise ValueError("attention cpu runs on the CPU in float32 only")
    if choice == "triton":
        if not has_triton:
            raise ValueError("attention triton needs the triton package: pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention triton on CPU runs only under the interpreter: set TRITON_INTERPRET=1"
            )
    return choice


def measured_mixed_prefill(prompt_token_ms: float) -> int:
    """The CPU's mixed-prefill cap for a model whose prompt token's matmuls take this long."""
    fits = int(CPU_CHUNK_MS / max(prompt_token_ms, 1e-6)) // CPU_CAP_STEP * CPU_CAP_STEP
    return min(max(fits, CPU_MIXED_PREFILL_TOKENS), CPU_CAP_MAX)
