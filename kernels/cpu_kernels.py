"""The compiled CPU kernels (`csrc/*.cpp`): built once, then loaded.

    paged_decode   csrc/paged_decode.cpp   a step's decodes attend, reading K/V in place from
                                           the pages (attention.py's reference gathers them),
                                           optionally in a sliding window, soft-capped
                   csrc/tile_attention.cpp with a bfloat16 KV, its two products on AMX tiles
                                           where the CPU has them
    store_kv                               the new tokens' K and V into their slots, one op
    paged_extend   csrc/paged_extend.cpp   a step's prompt chunks attend causally, reading K/V
                                           in place, a block of keys at a time (no window, no
                                           soft cap: those layers keep the reference)
    rms_norm       csrc/elementwise.cpp    RMSNorm of rows, in one op
    add_rms_norm                           the residual add and the next RMSNorm, in one op
    rope                                   q and k rotated in place, in one op
    silu_mul                               silu(gate) * up of the fused gate_up, in one op
    f32_linear     csrc/linear.cpp         x w.T + b, float32 weights packed in panels of 16
                                           channels (`PackedLinear`, linear.py; panels.h)
    f32_silu_mul                           silu(gate) * up of a gated MLP's gate_up in one op,
                                           over gated panels (`GatedPanels`, linear.py)
    bf16_panel_linear  csrc/bf16_panels.cpp  x w.T + b, bfloat16 weights packed in panels of
                                           16 channels, AVX512-BF16's dot products where the
                                           CPU has them and no AMX (`Bf16Linear`, bf16_linear.py)
    bf16_silu_mul                          silu(gate) * up of a gated MLP's gate_up in one op,
                                           over gated bfloat16 panels, the act in bfloat16
                                           (`GatedBf16Linear`, bf16_gated.py)
    q8_linear      csrc/block_linear.cpp   x w.T + b with weights in int8 or 4-bit blocks of
    q4_linear                              32, x in int16 (`quantization="int8"`, quant.py)
    DecoderLayers  csrc/decoder_layers.cpp a class: the standard layers of a decode-only step,
                                           the kernels above chained in C++
                                           (models/fused_layers.py)
    argmax_rows    csrc/argmax.cpp         each row's argmax, as torch's, vectorized (greedy.py)
    top_rows       csrc/top_rows.cpp       each row's k largest logits' indices, vectorized
                                           (top_indices.py: the bfloat16 head's candidates)

They are what `attention="cpu"` (the default on the CPU in float32) runs: the decode attention
and prompt-chunk attention here (a windowed or soft-capped layer's chunks through the torch
reference), and the element-wise ops through
`elementwise.CompiledElementwise` in the model.

The sources are compiled by torch's extension builder (a C++ compiler and ninja are needed)
once per key into `<cache_dir>/kernels/shoal_cpu_kernels_<capability>_<key>/` (kernel_build.py:
the key hashes the sources and headers, the flags, torch's version and location and Python's, so
two environments never rebuild each other's; the capability is the CPU's vector capability as
torch reports it, `avx512_vnni` where an AVX-512 CPU has VNNI (cpu_features.py), so a cache
shared by machines of different CPUs never loads code built for another). The build takes 1-2
minutes on 2 cores (AVX512, g++ 12, -O3: 55 s on idle cores, 116 s beside other work), in a
child process that a cancelled start stops; a later start only loads the built library. The
ops are `torch.ops.shoal_cpu.*`, registered once per process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from shoal.kernels.cpu_features import read_cpu_features
from shoal.kernels.kernel_build import ExtensionSpec, KernelUnavailable, load_extension

__all__ = ["CpuKernels", "KernelUnavailable", "build_isa", "capability", "load_cpu_kernels"]

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_decode.cpp", "paged_extend.cpp", "tile_attention.cpp", "elementwise.cpp",
        "linear.cpp", "block_linear.cpp", "bf16_panels.cpp", "decoder_layers.cpp", "argmax.cpp",
        "top_rows.cpp",
    )
)  # fmt: skip

# torch's CPU capability -> compiler flags. CPU_CAPABILITY selects ATen's vector type
# (at::vec::Vectorized) as torch's own kernels are built for that capability; no contraction
# into fused multiply-adds, so RoPE stays bit-equal to torch's separate multiplies and add.
CAPABILITY_FLAGS: dict[str, list[str]] = {
    "AVX512": [
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}  # fmt: skip
# The sources compiled as 2 units (build_units.py): torch's headers, most of each file's compile
# time, parsed twice instead of ten times, and the two compile side by side on 2 cores.
UNITS = 2
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# On an AVX-512 CPU with VNNI (cpu_features.py): the int8 blocks' dot products in one
# instruction (vpdpwssd, csrc/block_linear.cpp). A build of its own: a CPU without VNNI never
# loads it.
VNNI_FLAGS = ["-mavx512vnni", "-DSHOAL_VNNI"]


class StoreKernel(Protocol):
    def __call__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None: ...


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
        window: int = 0,  # > 0: each sequence attends to its last `window` tokens only
        softcap: float = 0.0,  # > 0: logits become softcap * tanh(logits / softcap)
    ) -> None: ...


class ExtendKernel(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        num_new: torch.Tensor,
        token_start: torch.Tensor,
        page_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...


@dataclass(frozen=True)
class CpuKernels:
    """The loaded ops (signatures in the sources' comments)."""

    paged_decode: DecodeKernel
    store_kv: StoreKernel
    paged_extend: ExtendKernel
    rms_norm: Any
    add_rms_norm: Any
    rope: Any
    silu_mul: Any
    f32_linear: Any
    f32_silu_mul: Any
    q8_linear: Any
    q4_linear: Any


def capability() -> str:
    reported = torch.backends.cpu.get_cpu_capability()
    return reported if reported in CAPABILITY_FLAGS else "DEFAULT"


def with_vnni() -> bool:
    """Whether the build for this CPU takes VNNI's dot products (AVX-512 builds only)."""
    return capability() == "AVX512" and read_cpu_features().vnni


def build_isa() -> str:
    """The build's name for this CPU: its capability, `_vnni` where it has those."""
    return capability().lower() + ("_vnni" if with_vnni() else "")


def spec() -> ExtensionSpec:
    """The kernels for this CPU's capability, as kernel_build builds them."""
    extra = VNNI_FLAGS if with_vnni() else []
    return ExtensionSpec(
        name=f"shoal_cpu_kernels_{build_isa()}",
        sources=SOURCES,
        depends=tuple(sorted(CSRC.glob("*.h"))),
        cflags=(*COMMON_FLAGS, *CAPABILITY_FLAGS[capability()], *extra),
        ldflags=("-fopenmp",),
        takes="about 1 minute on 2 cores",
        units=UNITS,
    )


def load_cpu_kernels(cache_dir: Path, cancel: threading.Event | None = None) -> CpuKernels:
    """The ops, built into `cache_dir` the first time (KernelUnavailable if they cannot be;
    StartCancelled when `cancel` is set while they build)."""
    if not hasattr(torch.ops.shoal_cpu, "store_kv"):
        library = load_extension(spec(), cache_dir, cancel=cancel)
        if not hasattr(torch.ops.shoal_cpu, "store_kv"):
            raise KernelUnavailable(f"the CPU kernels in {library} registered no op")
    ops = torch.ops.shoal_cpu
    return CpuKernels(
        ops.paged_decode,
        ops.store_kv,
        ops.paged_extend,
        ops.rms_norm,
        ops.add_rms_norm,
        ops.rope,
        ops.silu_mul,
        ops.f32_linear,
        ops.f32_silu_mul,
        ops.q8_linear,
        ops.q4_linear,
    )
