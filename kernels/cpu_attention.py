"""The compiled CPU decode-attention kernel (`csrc/paged_decode.cpp`): build once, then load.

A decode step's attention on the CPU reads each sequence's K/V where it lies in the pages, all
query heads of a KV head together (`csrc/paged_decode.cpp`), instead of gathering the pages
into a padded copy and calling SDPA (the reference in attention.py, which stays the path for
prompt chunks and the fallback for decodes).

The source is compiled by torch's extension builder (a C++ compiler and ninja are needed; about
15 s on 2 cores) into `<cache_dir>/kernels/<name>/`, named by the CPU's vector capability as
torch reports it, so a cache shared by machines of different CPUs never loads code built for
another. A later start only loads the built library (torch's builder rebuilds when the source or
the flags change). The op is then `torch.ops.shoal_cpu.paged_decode`, registered once per
process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"

# torch's CPU capability -> compiler flags. CPU_CAPABILITY selects ATen's vector type
# (at::vec::Vectorized) as torch's own kernels are built for that capability.
CAPABILITY_FLAGS: dict[str, list[str]] = {
    "AVX512": [
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}  # fmt: skip


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, an unsupported CPU...)."""


class DecodeKernel(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        token_index: torch.Tensor,
        page_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...


def capability() -> str:
    reported = torch.backends.cpu.get_cpu_capability()
    return reported if reported in CAPABILITY_FLAGS else "DEFAULT"


def load_decode_kernel(cache_dir: Path) -> DecodeKernel:
    """The paged decode op, built into `cache_dir` the first time (KernelUnavailable if not)."""
    if not hasattr(torch.ops.shoal_cpu, "paged_decode"):
        build(cache_dir)
    kernel: DecodeKernel = torch.ops.shoal_cpu.paged_decode
    return kernel


def build(cache_dir: Path) -> None:
    from torch.utils.cpp_extension import load  # imports setuptools: only when building

    name = f"shoal_cpu_attention_{capability().lower()}"
    folder = cache_dir / "kernels" / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        log.info("loading the CPU attention kernel (built into %s on first use, ~15 s)", folder)
        load(
            name,
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp", *CAPABILITY_FLAGS[capability()]],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # the builder raises whatever the compiler or ninja did
        raise KernelUnavailable(f"the CPU attention kernel could not be built: {error}") from error
    if not hasattr(torch.ops.shoal_cpu, "paged_decode"):
        raise KernelUnavailable(f"the CPU attention kernel built in {folder} registered no op")
