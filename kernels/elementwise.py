"""The model's element-wise ops, two ways: torch's ops (any device; the reference) or the
compiled CPU kernels (cpu_kernels.py), one op each where torch takes five or six.

    rms_norm(x, w)              RMSNorm computed in float32, as Hugging Face Llama does
    add_rms_norm(h, delta, w)   (h + delta, rms_norm(h + delta, w)): the residual add fused
                                with the next norm; the compiled form adds into h in place
    rope(x, cos, sin)           x: [T, H, D] rotated; the compiled form rotates x in place
    silu_mul(gate_up)           silu(gate) * up of the fused [T, 2I] projection, [T, I]

The compiled forms are bit-equal to the reference for RoPE, SiLU-and-multiply and the residual
add, and within the last bit for RMSNorm (another summation order of the squares;
tests/kernels/test_cpu_kernels.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.rope import apply_rope


class Elementwise(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class TorchElementwise:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + delta
        return h, rms_norm(h, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CompiledElementwise:
    """float32 CPU tensors only (what `attention="cpu"` guarantees)."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype)
        self.kernels.rms_norm(x, weight, eps, out)
        return out

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(h.shape, dtype=h.dtype)
        self.kernels.add_rms_norm(h, delta, weight, eps, out)
        return h, out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.kernels.rope(x, cos, sin)
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self.kernels.silu_mul(gate_up, out)
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Hugging Face Llama does. For float32 inputs torch's own
    kernel gives the same bits (checked in tests/models/test_model_ops.py) in one op instead of
    six."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
