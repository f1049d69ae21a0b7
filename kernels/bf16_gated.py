"""A SiLU-gated MLP's gate_up in bfloat16 panels (`dtype="bfloat16"` where the weights take the
compiled panels, bf16_linear.py): packed as 8 gate channels and their 8 up channels a panel,
so that `silu_mul(x)` is one op (`bf16_silu_mul`, csrc/bf16_panels.cpp) that multiplies,
activates while the tile is in registers and writes the down's input in bfloat16.

The plain panels wrote the [T, 2I] float32 product, `silu_mul` read it and wrote [T, I] float32,
and the down's call read that and rounded it to bfloat16: three passes over memory that a
prompt's rows do not fit in cache for. The gated op gives the same bits (the same float32
sums, silu.h's formula, the same rounding to nearest even), and the down takes its bfloat16
input as it is.

    gate_up = GatedBf16Linear(weight)     # weight [2I, K]: the gate's rows, then the up's
    act = gate_up.silu_mul(x)             # [.., K] -> [.., I] bfloat16
    product = gate_up(x)                  # [.., 2I] float32, as any linear gives it
"""

from __future__ import annotations

import torch

from shoal.kernels import bf16_linear
from shoal.kernels.bf16_linear import PANEL, pack_bf16_panels
from shoal.kernels.linear import gated_rows, ungated


def gated_bf16_available(in_features: int) -> bool:
    """Whether a gate_up of that K takes gated bfloat16 panels here: the bfloat16 linears take
    the compiled panels (bf16_panels_available()), K is even, and the kernels have the op."""
    return (
        in_features % 2 == 0
        and bf16_linear.bf16_panels_available()
        and hasattr(torch.ops.shoal_cpu, "bf16_silu_mul")
    )


def pack_gated_bf16_panels(gate_up: torch.Tensor) -> torch.Tensor:
    """[2I, K] (gate rows, then up rows; K even) -> [ceil(I / 8), K / 2, 32] bfloat16: panel p
    holds gate channels 8p .. 8p + 7 and then the same up channels (past I: zeros), in
    `pack_bf16_panels`' layout (linear.gated_rows, as float32's gated panels)."""
    return pack_bf16_panels(gated_rows(gate_up))


class GatedBf16Linear:
    """A SiLU-gated gate_up ([2I, K], no bias) in gated bfloat16 panels. Built only where
    gated_bf16_available(K) (linear.make_linear, int8_gated.GatedInt8Linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert bias is None, "a gate_up with a bias stays a Bf16Linear"
        self.out_features = int(weight.shape[0])
        self.inter = self.out_features // 2
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The product itself, [.., K] -> [.., 2I] float32 (gate, then up)."""
        flat = _rows(x)
        y = torch.empty(flat.shape[0], int(self.panels.shape[0]) * PANEL)
        torch.ops.shoal_cpu.bf16_panel_linear(flat, self.panels, None, y)
        return ungated(y, self.inter).view(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """silu(gate) * up: [.., K] float32 or bfloat16 -> [.., I] bfloat16."""
        flat = _rows(x)
        out = torch.empty(flat.shape[0], self.inter, dtype=torch.bfloat16)
        torch.ops.shoal_cpu.bf16_silu_mul(flat, self.panels, out)
        return out.view(*x.shape[:-1], self.inter)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert bias is None
        assert int(weight.shape[0]) == self.out_features, weight.shape
        self.panels = pack_gated_bf16_panels(weight)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, K] contiguous rows of float32 or bfloat16, as the kernels take them."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.dtype not in (torch.float32, torch.bfloat16):
        flat = flat.float()
    return flat.contiguous()
