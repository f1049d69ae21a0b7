"""Engine configuration: the user's options, resolved once at start into narrow sections."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What a user may set. Zero / None means "pick for me"."""

    page_size: int = 16
    kv_cache_tokens: int = 32768
    max_running_requests: int = 64
    chunk_size: int = 512
    max_batch_tokens: int = 2048
    max_inflight: int = 2
    context_length: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None
    seed: int | None = None
    strict_integrity: bool = False
    prefix_cache: bool = True
    max_sessions: int = 256

    def validate(self) -> None:
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
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")


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


def resolve(options: EngineOptions, model_context: int) -> Resolved:
    options.validate()
    page_size = options.page_size
    num_pages = -(-options.kv_cache_tokens // page_size)
    context = min(options.context_length or model_context, model_context)
    # One request alone must always fit, or it could wait forever.
    context = min(context, (num_pages - 1) * page_size)
    if context < 2:
        raise ValueError("kv_cache_tokens is too small for even one request")
    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    max_pages_per_row = -(-context // page_size) + 1
    layout = CacheLayout(page_size, num_pages, options.max_running_requests, max_pages_per_row)
    return Resolved(layout, context, DTYPES[options.dtype], torch.device(device))
