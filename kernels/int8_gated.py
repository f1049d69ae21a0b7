"""A SiLU-gated MLP's gate_up for `quantization="int8"` (quant.py's blocks for steps of few
rows): from many_rows() rows on, its dequantized weights in gated panels, float32 ones
(`GatedPanels`' layout) or bfloat16 ones (`GatedBf16Linear`, where the many rows multiply in
bfloat16 panels), so that `silu_mul(x)` is one op."""

from __future__ import annotations

import torch

from shoal.kernels.bf16_gated import GatedBf16Linear, gated_bf16_available
from shoal.kernels.bf16_linear import Bf16Linear
from shoal.kernels.int8_rows import ManyRows
from shoal.kernels.linear import gated_product, pack_gated_panels
from shoal.kernels.quant import Int8Linear, float_rows


class GatedInt8Linear(Int8Linear):
    """A SiLU-gated MLP's fused gate_up ([2I, K]: the gate's rows, then the up's) in blocks,
    its float32 panels gated as `GatedPanels` holds them (or its bfloat16 panels as
    `GatedBf16Linear` does, where the many rows multiply in them), so that from many_rows() rows
    on `silu_mul(x)` is one op (`f32_silu_mul`, `bf16_silu_mul`) with the bits of the product
    and then `silu_mul`; fewer rows take the blocks' product and then `silu_mul`, as a plain one
    does."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, form: ManyRows | None = None
    ) -> None:
        assert bias is None, "a gate_up with a bias stays an Int8Linear"
        self.inter = int(weight.shape[0]) // 2
        super().__init__(weight, bias, form=form)

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        count = x.numel() // self.in_features if rows is None else rows
        if not self.takes_many(count) or self.tiles is not None:
            return super().__call__(x, count)
        assert self.panels is not None  # no AMX tiles: float32 panels
        y = gated_product(float_rows(x, self.in_features), self.panels, self.inter)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def silu_mul(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """silu(gate) * up: [.., K] -> [.., I]; bfloat16 from gated bfloat16 panels (the
        down's many rows take it as it is), else x's dtype."""
        flat = float_rows(x, self.in_features)
        count = flat.shape[0] if rows is None else rows
        if self.takes_many(count) and isinstance(self.tiles, GatedBf16Linear):
            return self.tiles.silu_mul(flat).view(*x.shape[:-1], self.inter)
        out = torch.empty(flat.shape[0], self.inter)
        if self.takes_many(count) and self.panels is not None:
            torch.ops.shoal_cpu.f32_silu_mul(flat, self.panels, out)
        else:
            torch.ops.shoal_cpu.silu_mul(super().__call__(flat, count), out)
        return out.view(*x.shape[:-1], self.inter).to(x.dtype)

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return pack_gated_panels(weight)

    def _tiles(self, weight: torch.Tensor) -> Bf16Linear | GatedBf16Linear:
        if gated_bf16_available(self.in_features):
            return GatedBf16Linear(weight, None)
        return Bf16Linear(weight, None)
