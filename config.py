"""Engine configuration: the user's options, resolved once at start into narrow sections."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from shoal.kernels.linear import LinearKind, packing_available
from shoal.limits import InputLimits

DEFAULT_LIMITS = InputLimits()


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What a user may set. Zero / None means "pick for me"."""

    page_size: int = 16
    kv_cache_tokens: int = 32768
    max_running_requests: int = 64
    chunk_size: int = 512
    max_batch_tokens: int = 2048
    # Prompt tokens a step that also decodes may take (0: up to max_batch_tokens). Lower:
    # steadier inter-token latency under load, newcomers' first token a little later.
    max_mixed_prefill_tokens: int = 128
    max_inflight: int = 2
    context_length: int | None = None
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # CUDA when available
    attention: str = "auto"  # triton on CUDA; on CPU the compiled kernels (float32)
    quantization: str | None = None  # "int8": int8 weights in blocks, float32 activations (CPU)
    cuda_graph_max_batch: int = 128  # decode batches up to this replay CUDA graphs; 0 = off
    num_threads: int | None = None
    seed: int | None = None
    strict_integrity: bool = False
    prefix_cache: bool = True
    max_sessions: int = 256
    # input limits every door shares, the Python API included (limits.py, docs/limits.md)
    max_stop_strings: int = DEFAULT_LIMITS.max_stop_strings
    max_stop_chars: int = DEFAULT_LIMITS.max_stop_chars
    max_stop_token_ids: int = DEFAULT_LIMITS.max_stop_token_ids
    max_prompt_chars: int = DEFAULT_LIMITS.max_prompt_chars
    max_messages: int = DEFAULT_LIMITS.max_messages

    def input_limits(self) -> InputLimits:
        return InputLimits(**{name: getattr(self, name) for name in InputLimits.__struct_fields__})

    def validate(self) -> None:
        self.input_limits().validate()
        for name in (
            "page_size",
            "kv_cache_tokens",
            "max_running_requests",
            "chunk_size",
            "max_batch_tokens",
            "max_inflight",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_mixed_prefill_tokens < 0:
            raise ValueError(
                f"max_mixed_prefill_tokens must be >= 0, got {self.max_mixed_prefill_tokens}"
            )
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            choices = ["auto", *sorted(DTYPES)]
            raise ValueError(f"dtype must be one of {choices}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be int8 or unset, got {self.quantization!r}")


QUANTIZATIONS = (None, "int8")

ATTENTIONS = ("auto", "torch", "triton", "cpu")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    dtype: torch.dtype
    device: torch.device
    attention: str  # "torch" | "triton" | "cpu"
    cuda_graph_max_batch: int  # 0 = no graphs (always 0 off CUDA or without Triton)
    linear_kind: LinearKind  # how the forward multiplies by weights (kernels/linear.py)


def resolve(options: EngineOptions, model_context: int) -> Resolved:
    options.validate()
    page_size = options.page_size
    num_pages = -(-options.kv_cache_tokens // page_size)
    context = min(options.context_length or model_context, model_context)
    # One request alone must always fit, or it could wait forever.
    context = min(context, (num_pages - 1) * page_size)
    if context < 2:
        raise ValueError("kv_cache_tokens is too small for even one request")
    device, dtype = resolve_device(options)
    attention = resolve_attention(options, device, dtype)
    graphs = 0
    if device.type == "cuda" and attention == "triton":
        graphs = min(options.cuda_graph_max_batch, options.max_running_requests)
    max_pages_per_row = -(-context // page_size) + 1
    layout = CacheLayout(page_size, num_pages, options.max_running_requests, max_pages_per_row)
    linear = resolve_linear(options, device, dtype)
    return Resolved(layout, context, dtype, device, attention, graphs, linear)


def resolve_linear(options: EngineOptions, device: torch.device, dtype: torch.dtype) -> LinearKind:
    """int8 when asked for (CPU only); else packed float32 on the CPU; else dense."""
    if options.quantization == "int8":
        if device.type != "cpu":
            raise ValueError("quantization int8 runs on the CPU only")
        return "int8"
    return "packed" if packing_available(device, dtype) else "dense"


def resolve_device(options: EngineOptions) -> tuple[torch.device, torch.dtype]:
    """The device (auto: CUDA when available) and the weights' dtype (auto: bf16 on CUDA)."""
    name = options.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    dtype_name = options.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if name == "cuda" else "float32"
    return torch.device(name), DTYPES[dtype_name]


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
