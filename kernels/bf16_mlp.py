"""A SiLU-gated MLP whose two matmuls are both bfloat16 (`Bf16Linear`: `dtype="bfloat16"` on the
CPU, and int8's steps of many rows on a CPU with bfloat16 dot products, quant.py): the gate_up's
product stays bfloat16, silu_mul reads it and writes the down's input in bfloat16
(csrc/elementwise.cpp), instead of widening the product to float32, multiplying, and rounding
the activation to bfloat16 again at the down's call. The same bits (widening is exact, the
float32 formula is the same, the rounding the same); two full passes over [T, 2I] and [T, I]
fewer.

    pair = bf16_pair(mlp.gate_up, mlp.down, x, rows)   # None: the usual path
    out = pair.run(x, elementwise.silu_mul)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.kernels.bf16_linear import Bf16Head, Bf16Linear
from shoal.kernels.quant import Int8Linear

__all__ = ["Bf16Pair", "bf16_pair"]


@dataclass(frozen=True)
class Bf16Pair:
    gate_up: Bf16Linear
    down: Bf16Linear

    def run(
        self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """down(silu(gate) * up) of x [.., K] float32: [.., hidden] float32."""
        act = silu_mul(self.gate_up.product(x.reshape(-1, x.shape[-1])))
        return self.down(act).view(*x.shape[:-1], -1)


def bf16_pair(
    gate_up: object, down: object, x: torch.Tensor, rows: int | None = None
) -> Bf16Pair | None:
    """The two bfloat16 matmuls a step of x's rows (or standing for `rows`, kernels/batch.py:
    kernel_rows) would run for this MLP, or None where either is not one (or has a bias: its
    product is added in float32)."""
    count = x.numel() // x.shape[-1] if rows is None else rows
    first, second = _bf16_of(gate_up, count), _bf16_of(down, count)
    if first is None or second is None:
        return None
    return Bf16Pair(first, second)


def _bf16_of(linear: object, rows: int) -> Bf16Linear | None:
    if isinstance(linear, Int8Linear):
        if not linear.takes_many(rows) or linear.tiles is None:
            return None
        linear = linear.tiles
    if not isinstance(linear, Bf16Linear) or isinstance(linear, Bf16Head):
        return None
    if linear.weight is None:  # the panels' form: its products are float32
        return None
    return linear if linear.bias is None else None
