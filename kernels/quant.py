"""Block-quantized linears for `quantization="int8"` (CPU): weights in blocks of 32 along K,
activations quantized per block of 32 at each call.

What is quantized how (y = x w.T + b, w: [N, K]), chosen per weight at each load:
    weight, Q4  4-bit with a float32 scale d and minimum m a block (w = q * d + m, GGUF's Q4_1),
                taken only where it is exact: a weight dequantized from a Q4_1 GGUF (the
                bundled SmolLM2's projections) is stored as it came, 0.625 bytes a weight.
    weight, Q8  otherwise int8, symmetric, with a float32 scale a block (the block's largest
                |w| maps to 127; GGUF's Q8_0): 1.125 bytes a weight.
    activation  int16 per row and block of 32 (the block's largest |x| maps to 32767), in the
                kernel at each call: off by at most 1.5e-5 of its block's largest value.
    out         float32, bias added in float32.

The kernels are `q4_linear` and `q8_linear` in csrc/block_linear.cpp (built with the other CPU
kernels, cpu_kernels.py): each block's product is summed exactly in int32, then scaled by both
scales in float32. The bundled SmolLM2 decodes through them at one row in ~2/3 of the time the
earlier float-activation int8 kernel took, and as exactly as float32 bar the activations' 15
bits (bench/README.md; 8-bit activations lost 3% of its top-1 agreement with float32).

They are for steps of a few rows, which read the weights more than they compute. From
MANY_ROWS rows on, the weights, dequantized once at load (every value as the blocks give it
back) and kept in float32 panels, go through `f32_linear` as float32 weights do: a step of many
rows computes, and the float32 panel kernel computes faster than the block kernels there. A
SiLU-gated MLP's gate_up keeps them gated (`GatedInt8Linear`), so that it multiplies and
activates in one op, as float32's does. The panels cost the float32 model's memory again (0.54
GB for SmolLM2). On a CPU with AMX the many-row steps multiply the dequantized weights rounded
to bfloat16 on the matrix tiles instead (bf16_linear.py; half that memory; the lm_head's top
logits again in float32): 6x the float32 panels' rate at 64 rows there, offline 1.97x float32,
99.30% top-1 agreement (bench/README.md). AMX's own int8 tiles would need 8-bit activations,
which cost SmolLM2 3% of its top-1 agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.bf16_linear import Bf16Head, Bf16Linear, amx_bf16
from shoal.kernels.linear import gated_product, pack_gated_panels, pack_panels

BLOCK = 32  # weights per scale, along K (the kernels' kBlock)
_Q8_LEVELS = 127
_Q4_LEVELS = 15
_MIN_SCALE = 1e-12  # a block of zeros still needs a positive scale
# From this many rows on a step computes more than it reads the weights, and the float32 panel
# kernel on the dequantized weight beats the block kernels (all of SmolLM2's linears: 8 rows
# 24.7 ms in blocks against 29.0, 12 rows 37.0 against 32.3; bench/README.md).
MANY_ROWS = 10


@dataclass(frozen=True)
class Q8Blocks:
    q: torch.Tensor  # int8 [N, B * 32], zero past K
    d: torch.Tensor  # float32 [N, B]
    in_features: int

    def run(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        torch.ops.shoal_cpu.q8_linear(x, self.q, self.d, bias, out)

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.q.shape[0], self.in_features)
        torch.ops.shoal_cpu.q8_dequantize(self.q, self.d, out)
        return out


@dataclass(frozen=True)
class Q4Blocks:
    q: torch.Tensor  # uint8 [N, B * 16]: byte j of a block holds k = j (low), j + 16 (high)
    d: torch.Tensor  # float32 [N, B]
    m: torch.Tensor  # float32 [N, B]

    def run(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        torch.ops.shoal_cpu.q4_linear(x, self.q, self.d, self.m, bias, out)

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.q.shape[0], self.q.shape[1] * 2)
        torch.ops.shoal_cpu.q4_dequantize(self.q, self.d, self.m, out)
        return out


class Int8Linear:
    """y = x @ w.T + b with w in Q4 or Q8 blocks of 32 along K, x and y float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, head: bool = False) -> None:
        if weight.device.type != "cpu":
            raise ValueError(f"quantization int8 runs on the CPU only, got {weight.device}")
        if not hasattr(torch.ops.shoal_cpu, "q4_linear"):
            raise ValueError(
                "quantization int8 needs the compiled CPU kernels, and they are not loaded "
                "(kernels/cpu_kernels.py: load_cpu_kernels)"
            )
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.head = head  # the lm_head: on the tiles, its top logits again in float32 (Bf16Head)
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = _float_rows(x, self.in_features)
        if rows.shape[0] >= MANY_ROWS and self.tiles is not None:
            out = self.tiles(rows)
        else:
            out = torch.empty(rows.shape[0], self.out_features)
            if rows.shape[0] >= MANY_ROWS:
                torch.ops.shoal_cpu.f32_linear(rows, self.panels, self.bias, out)
            else:
                self.blocks.run(rows, self.bias, out)
        y = out.view(*shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize a weight of this linear's shape (also a weight update)."""
        assert tuple(weight.shape) == (self.out_features, self.in_features), weight.shape
        weight = weight.detach().float()
        self.blocks: Q4Blocks | Q8Blocks = exact_q4_blocks(weight) or q8_blocks(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        # The same weights for steps of many rows (MANY_ROWS): on the matrix tiles in bfloat16
        # where the CPU has AMX, else in float32 panels.
        dequantized = self.blocks.dequantize()
        tiles = Bf16Head if self.head else Bf16Linear
        self.tiles = tiles(dequantized, self.bias) if amx_bf16() else None
        self.panels = self._pack(dequantized) if self.tiles is None else None

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by (for tests)."""
        return self.blocks.dequantize()

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return pack_panels(weight)


class GatedInt8Linear(Int8Linear):
    """A SiLU-gated MLP's fused gate_up ([2I, K]: the gate's rows, then the up's) in blocks,
    its float32 panels gated as `GatedPanels` holds them, so that from MANY_ROWS rows on
    `silu_mul(x)` is one op (`f32_silu_mul`) with the bits of the product and then `silu_mul`;
    fewer rows take the blocks' product and then `silu_mul`, as a plain one does."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert bias is None, "a gate_up with a bias stays an Int8Linear"
        self.inter = int(weight.shape[0]) // 2
        super().__init__(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features < MANY_ROWS or self.tiles is not None:
            return super().__call__(x)
        assert self.panels is not None  # no AMX tiles: float32 panels
        y = gated_product(_float_rows(x, self.in_features), self.panels, self.inter)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: [.., K] -> [.., I]."""
        rows = _float_rows(x, self.in_features)
        out = torch.empty(rows.shape[0], self.inter)
        if rows.shape[0] >= MANY_ROWS and self.panels is not None:
            torch.ops.shoal_cpu.f32_silu_mul(rows, self.panels, out)
        else:
            torch.ops.shoal_cpu.silu_mul(super().__call__(rows), out)
        return out.view(*x.shape[:-1], self.inter).to(x.dtype)

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return pack_gated_panels(weight)


def _float_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as contiguous float32 rows [T, K], as the kernels take them."""
    rows = x.reshape(-1, in_features)
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    return rows


def q8_blocks(weight: torch.Tensor) -> Q8Blocks:
    """int8 blocks of 32 along K, each within half a step of its scale of w."""
    n, k = weight.shape
    grouped = _padded(weight).view(n, -1, BLOCK)
    d = (grouped.abs().amax(dim=2) / _Q8_LEVELS).clamp_min(_MIN_SCALE)
    q = torch.round(grouped / d.unsqueeze(2)).clamp_(-_Q8_LEVELS, _Q8_LEVELS).to(torch.int8)
    return Q8Blocks(q.view(n, -1).contiguous(), d.contiguous(), k)


def exact_q4_blocks(weight: torch.Tensor) -> Q4Blocks | None:
    """The weight as Q4_1 blocks if that gives back every value to the bit, else None.

    A weight dequantized from Q4_1 is q * d + m with q in 0..15 and d a float16; GGUF's
    quantizer puts each block's minimum at q = 0 and its maximum at 15, so m is the minimum,
    (max - min) / 15 rounds back to d in float16, and that finds q again."""
    n, k = weight.shape
    if k % BLOCK:
        return None
    grouped = weight.reshape(n, -1, BLOCK)
    m = grouped.amin(dim=2)
    d = ((grouped.amax(dim=2) - m) / _Q4_LEVELS).half().float()
    if not bool(torch.isfinite(d).all()):
        return None
    step = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(2)
    q = torch.round((grouped - m.unsqueeze(2)) / step).clamp_(0, _Q4_LEVELS)
    if not torch.equal(q * d.unsqueeze(2) + m.unsqueeze(2), grouped):
        return None
    q = q.to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return Q4Blocks(packed.reshape(n, -1).contiguous(), d.contiguous(), m.contiguous())


def _padded(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    padded = torch.zeros(n, -(-k // BLOCK) * BLOCK)
    padded[:, :k] = weight
    return padded
