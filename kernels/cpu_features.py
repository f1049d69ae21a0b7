"""What the CPU can do, read at run time, and the kernels shoal picks for it.

Every start reads the CPU's model and features (Linux's /proc/cpuinfo, and torch's own checks,
which also ask the OS: AMX needs its permission) and picks its kernels from them without a
flag (resolve_options.py); `python -m shoal serve` logs the pick at start and every bench line
names it.

    feature        used by
    avx2           the compiled kernels' AVX2 build (csrc, kernel_build.py)
    avx512         their AVX-512 build: float32 tiles of two panels and 12 rows (csrc/panels.h)
    avx512_vnni    int8 blocks' dot products in one instruction (vpdpwssd, csrc/block_linear.cpp)
    avx512_bf16    bfloat16 matmuls in compiled panels (csrc/bf16_panels.cpp; oneDNN's without
                   the kernels, bf16_linear.py): the default dtype on the CPU
    amx_bf16       the same on the matrix tiles
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.kernels.bf16_linear import amx_bf16, onednn_bf16_available

CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo's names of the features above, in the order a report lists them
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # as lscpu names it: "Intel(R) Xeon(R) Processor", "AMD EPYC 7B13"
    flags: frozenset[str]  # those of FLAGS the CPU reports and torch confirms
    # cpuid's family and model numbers ("" where unknown): a VM's model name may be only
    # "AMD EPYC", on a Zen 4 (family 25) or a Zen 5 (26), whose kernels' speeds differ
    generation: str = ""

    def name(self) -> str:
        """The model and, where known, its family and model numbers: "AMD EPYC (family 26,
        model 2)"."""
        return f"{self.model} ({self.generation})" if self.generation else self.model

    @property
    def vnni(self) -> bool:
        return "avx512_vnni" in self.flags

    @property
    def bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        return "amx_bf16" in self.flags and "amx_tile" in self.flags

    def isa(self) -> str:
        """The features as one word: avx2+avx512f+avx512_vnni+avx512_bf16+amx_tile+..."""
        return "+".join(flag for flag in FLAGS if flag in self.flags) or "none"


def read_cpu_features(cpuinfo: Path = CPUINFO) -> CpuFeatures:
    """The CPU's model and features (none where /proc/cpuinfo cannot be read)."""
    model, words = "unknown", set[str]()
    numbers: dict[str, str] = {}  # "cpu family", "model": the first processor's
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key == "flags" and not words:
                words = set(value.split())
            elif key in ("cpu family", "model") and key not in numbers:
                numbers[key] = value.strip()
    except OSError:
        pass
    generation = ""
    if "cpu family" in numbers and "model" in numbers:
        generation = f"family {numbers['cpu family']}, model {numbers['model']}"
    confirmed = {flag for flag in FLAGS if flag in words}
    # torch's checks include the OS's consent (AMX tiles need the kernel's permission)
    if not torch.cpu._is_amx_tile_supported():
        confirmed -= {"amx_tile", "amx_bf16", "amx_int8"}
    if not torch.cpu._is_avx512_bf16_supported():
        confirmed.discard("avx512_bf16")
    return CpuFeatures(model, frozenset(confirmed), generation)


def bf16_by_default(features: CpuFeatures) -> bool:
    """Whether `dtype="auto"` takes bfloat16 weights on this CPU: where oneDNN multiplies
    bfloat16 with its dot products, on the matrix units (AMX: its matmuls 2.5-8x the float32
    kernels at SmolLM2's shapes from 16 rows, offline 2.1x float32) or AVX512-BF16 alone (an
    AMD EPYC: offline 1.27-1.46x float32, a decode step of 16 sequences 1.6-2.5x, one
    sequence even; bench/README.md). Without either, oneDNN has no bfloat16 kernel: float32."""
    return (features.amx_bf16 and amx_bf16()) or (features.bf16 and onednn_bf16_available())


def kernel_report(
    device: torch.device,
    linear_kind: str,
    attention: str,
    features: CpuFeatures | None = None,
    *,
    kv_dtype: torch.dtype | None = None,
    f32_many_rows: int | None = None,
) -> str:
    """One line naming the CPU, its features and the kernels picked, as the serve log gives it:
    `cpu="Intel(R) Xeon(R) Processor" isa=avx2+avx512f+... linear=bf16:onednn-amx
    attention=cpu:avx512_vnni kv=bfloat16`."""
    cpu = features or read_cpu_features()
    picked = kernel_choice(device, linear_kind, attention, cpu, f32_many_rows=f32_many_rows)
    if kv_dtype is not None:  # a bfloat16 KV's decode attention on the tiles (tile_attention.cpp)
        tiles = kv_dtype == torch.bfloat16 and attention == "cpu" and "amx_bf16" in cpu.flags
        picked += f" kv={str(kv_dtype).removeprefix('torch.')}" + (":amx-tiles" if tiles else "")
    if device.type != "cpu":
        return picked
    return f'cpu="{cpu.name()}" isa={cpu.isa()} {picked}'


def kernel_choice(
    device: torch.device,
    linear_kind: str,
    attention: str,
    features: CpuFeatures | None = None,
    *,
    f32_many_rows: int | None = None,
) -> str:
    """The kernels picked: `linear=<kind>:<how> attention=<backend>[:<build>]`, where how is
    panels-<build> (float32, csrc/panels.h; then `+onednn@<rows>` where a start measured
    oneDNN faster for steps of that many rows or more: `f32_many_rows`, f32_many_rows.py),
    onednn (float32 without the compiled kernels),
    onednn-amx / panels-avx512bf16 (csrc/bf16_panels.cpp) / onednn-avx512bf16 (without the
    compiled kernels) / onednn-emulated (bfloat16), blocks-<build> (int8, then
    `+<how>@<rows>`: the form its steps of many rows take, int8_rows.py) or torch (dense),
    and the build the compiled kernels' (cpu_kernels.build_isa)."""
    if device.type != "cpu":
        return f"linear={linear_kind}:torch attention={attention}"
    from shoal.kernels.cpu_kernels import build_isa

    cpu = features or read_cpu_features()
    built = build_isa()
    compiled = hasattr(torch.ops.shoal_cpu, "f32_linear")  # loaded: cpu_kernels.py
    panels = hasattr(torch.ops.shoal_cpu, "bf16_panel_linear")  # bf16_linear.py's form
    if "amx_bf16" in cpu.flags:
        bf16 = "onednn-amx"
    elif "avx512_bf16" in cpu.flags:
        bf16 = "panels-avx512bf16" if panels else "onednn-avx512bf16"
    else:
        bf16 = "onednn-emulated"
    how = {
        "packed": f"panels-{built}{f32_onednn(f32_many_rows)}" if compiled else "onednn",
        "bf16": bf16 if bf16.startswith("panels") or onednn_bf16_available() else "torch",
        "int8": f"blocks-{built}{int8_many_rows(cpu, bf16, built)}",
        "dense": "torch",
    }.get(linear_kind, linear_kind)
    where = f"cpu:{built}" if attention == "cpu" else attention
    return f"linear={linear_kind}:{how} attention={where}"


def f32_onednn(f32_many_rows: int | None) -> str:
    """`+onednn@<rows>` where float32's steps of that many rows take oneDNN, else ""."""
    from shoal.kernels.linear import NEVER

    return "" if f32_many_rows is None or f32_many_rows >= NEVER else f"+onednn@{f32_many_rows}"


def int8_many_rows(cpu: CpuFeatures, bf16: str, built: str) -> str:
    """`+<how>@<rows>` for int8's steps of many rows on that CPU (int8_rows.py), "" where
    its blocks take every step."""
    from shoal.kernels.int8_rows import form_for
    from shoal.kernels.linear import NEVER

    form = form_for(cpu, onednn_bf16_available(), built.endswith("_vnni"))
    if form.rows == NEVER:
        return ""
    return f"+{bf16 if form.bf16 else 'panels'}@{form.rows}"
