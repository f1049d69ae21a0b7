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
kernels, cpu_kernels.py), the weights in panels of 16 output channels (csrc/blocks.h; `values`
and `dequantize` give them back as rows): each block's product is summed exactly in int32, 16
channels a vpmaddwd / vpdpwssd, then scaled by both scales in float32, up to 8 rows a pass
over the weights. The bundled SmolLM2's 30 layers' projections take ~2.2 ms at one row on the
2-core AMD EPYC (AVX-512 VNNI), half what a block of one channel at a time took, and ~8 ms at 9
rows against ~25 (bench/README.md), as exactly as float32 bar the activations' 15 bits (8-bit
activations lost 3% of its top-1 agreement with float32).

They are for steps that read the weights more than they compute. From many_rows() rows on, the
weights, dequantized once at load (every value as the blocks give it back), multiply in
bfloat16 where the CPU has bfloat16 dot products (bf16_linear.py; the lm_head's top logits
again in float32): on AMX's tiles through oneDNN from 10 rows (6x the float32 panels' rate at
64 rows there, offline 1.97x float32, 99.30% top-1 agreement), with AVX512-BF16 alone in
shoal's bfloat16 panels from 24 rows (the layers 1.24x the blocks at 64 rows on the Zen 5
EPYC, the head 1.52x; int8_rows.py, bench/README.md). Without them, through `f32_linear`
in float32 panels as float32 weights do (an AVX2 build: from 24 rows), and where the CPU has
VNNI the blocks take every step: they beat the float32 panels at every size. A SiLU-gated
MLP's gate_up keeps its panels gated (`GatedInt8Linear`, int8_gated.py), so that it
multiplies and activates in one op, as float32's does. The panels cost the float32 model's
memory again (0.54 GB for SmolLM2), the bfloat16 weights half that (and the head's float32
weight again, for its top logits); none is kept where the blocks take every step.
AMX's own int8 tiles would need 8-bit activations (so would VNNI's vpdpbusd, twice the
bfloat16 dot products' rate on the Zen 5 EPYC): rounded symmetric they cost SmolLM2 about 3%
of its top-1 agreement; rounded unsigned from each block of 32's minimum, 1.8% (98.23%,
bench/act8_emulation.py). A kernel of them (bench/w8a8_probe.py) applies both sides' scales
and minimums every block of 32, and that epilogue keeps it at 1.04-1.21x the bfloat16 panels
from 64 rows on the Zen 5 (about 1.4x at most, by a model of its pipes; docs/cpu-step.md, "int8
on VNNI and AMX"), for 1.8 points of top-1: not wired in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.bf16_gated import GatedBf16Linear
from shoal.kernels.bf16_linear import Bf16Head, Bf16Linear
from shoal.kernels.int8_rows import ManyRows, many_rows
from shoal.kernels.linear import NEVER, pack_panels

BLOCK = 32  # weights per scale, along K (the kernels' kBlock)
PAIRS = BLOCK // 2  # pairs of K a block (kPairs)
PANEL = 16  # output channels a panel (kPanel)
_Q8_LEVELS = 127
_Q4_LEVELS = 15
_MIN_SCALE = 1e-12  # a block of zeros still needs a positive scale


@dataclass(frozen=True)
class Q8Blocks:
    """int8 blocks in panels of PANEL output channels (csrc/blocks.h): P = ceil(N / 16)."""

    q: torch.Tensor  # int8 [P, B, 512]: a block's 16 pairs of K, each 16 channels x 2
    d: torch.Tensor  # float32 [P, B, 16]
    out_features: int
    in_features: int

    def run(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        torch.ops.shoal_cpu.q8_linear(x, self.q, self.d, bias, out)

    def values(self) -> torch.Tensor:
        """The int8 weights as [N, B * 32] (zero past K)."""
        return _rows_of_panels(self.q.view(*self.q.shape[:2], PAIRS, PANEL, 2), self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], q * d (one rounding)."""
        w = self.values().float() * _per_weight(self.d, self.out_features)
        return w[:, : self.in_features].contiguous()


@dataclass(frozen=True)
class Q4Blocks:
    """GGUF Q4_1's blocks in panels of PANEL output channels (csrc/blocks.h)."""

    q: torch.Tensor  # uint8 [P, B, 256]: byte i of group g: pair g's byte i (low), g + 8's (high)
    d: torch.Tensor  # float32 [P, B, 16]
    m: torch.Tensor  # float32 [P, B, 16]
    out_features: int

    def run(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        torch.ops.shoal_cpu.q4_linear(x, self.q, self.d, self.m, bias, out)

    def values(self) -> torch.Tensor:
        """The 4-bit weights (0 .. 15) as uint8 [N, K]."""
        groups = self.q.view(*self.q.shape[:2], PAIRS // 2, BLOCK)
        pairs = torch.cat([groups & 0x0F, groups >> 4], dim=2)
        return _rows_of_panels(pairs.view(*self.q.shape[:2], PAIRS, PANEL, 2), self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], q * d + m (a rounding each)."""
        n = self.out_features
        scaled = self.values().float() * _per_weight(self.d, n)
        return (scaled + _per_weight(self.m, n)).contiguous()


def _rows_of_panels(pairs: torch.Tensor, n: int) -> torch.Tensor:
    """[P, B, 16 pairs, 16 channels, 2] -> [N, B * 32]."""
    panels, blocks = pairs.shape[:2]
    rows = pairs.permute(0, 3, 1, 2, 4).reshape(panels * PANEL, blocks * BLOCK)
    return rows[:n]


def _per_weight(scales: torch.Tensor, n: int) -> torch.Tensor:
    """[P, B, 16] -> [N, B * 32], each scale repeated over its block."""
    panels, blocks = scales.shape[:2]
    rows = scales.permute(0, 2, 1).reshape(panels * PANEL, blocks)[:n]
    return rows.repeat_interleave(BLOCK, dim=1)


def _panels_of_rows(rows: torch.Tensor) -> torch.Tensor:
    """[N, B * 32] (any dtype) -> [P, B, 16 pairs, 16 channels, 2], channels past N zero."""
    n, k = rows.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=rows.dtype)
    padded[:n] = rows
    grouped = padded.view(panels, PANEL, k // BLOCK, PAIRS, 2)
    return grouped.permute(0, 2, 3, 1, 4).contiguous()


def _scale_panels(scales: torch.Tensor) -> torch.Tensor:
    """[N, B] -> [P, B, 16], channels past N zero."""
    n, blocks = scales.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, blocks)
    padded[:n] = scales
    return padded.view(panels, PANEL, blocks).permute(0, 2, 1).contiguous()


class Int8Linear:
    """y = x @ w.T + b with w in Q4 or Q8 blocks of 32 along K, x and y float32."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: bool = False,
        form: ManyRows | None = None,
    ) -> None:
        if weight.device.type != "cpu":
            raise ValueError(f"quantization int8 runs on the CPU only, got {weight.device}")
        if not hasattr(torch.ops.shoal_cpu, "q4_linear"):
            raise ValueError(
                "quantization int8 needs the compiled CPU kernels, and they are not loaded "
                "(kernels/cpu_kernels.py: load_cpu_kernels)"
            )
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.head = head  # the lm_head: in bfloat16, its top logits again in float32 (Bf16Head)
        # How it takes steps of many rows (many_rows(): a model's build decides it once for
        # all its linears)
        self.form = many_rows() if form is None else form
        self.many_rows = self.form.rows
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """`rows`: how many rows the step stands for (kernels/batch.py: kernel_rows; None: x's),
        which picks the blocks or the dequantized weights. x float32, or bfloat16 (a gated
        gate_up's activation from its bfloat16 panels: the bfloat16 weights take it as it is),
        gives float32."""
        shape = x.shape
        count = x.numel() // self.in_features if rows is None else rows
        many = self.takes_many(count)
        if many and self.tiles is not None and x.dtype == torch.bfloat16:
            flat_bf16 = x.reshape(-1, self.in_features)
            return self.tiles(flat_bf16).view(*shape[:-1], self.out_features)
        flat = float_rows(x, self.in_features)
        if many and self.tiles is not None:
            out = self.tiles(flat)
        else:
            out = torch.empty(flat.shape[0], self.out_features)
            if many:
                torch.ops.shoal_cpu.f32_linear(flat, self.panels, self.bias, out)
            else:
                self.blocks.run(flat, self.bias, out)
        y = out.view(*shape[:-1], self.out_features)
        return y if x.dtype in (torch.float32, torch.bfloat16) else y.to(x.dtype)

    def takes_many(self, rows: int) -> bool:
        """Whether a step standing for `rows` rows multiplies by the dequantized weights."""
        return rows >= self.many_rows

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize a weight of this linear's shape (also a weight update)."""
        assert tuple(weight.shape) == (self.out_features, self.in_features), weight.shape
        weight = weight.detach().float()
        self.blocks: Q4Blocks | Q8Blocks = exact_q4_blocks(weight) or q8_blocks(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        # The same weights for steps of many rows (many_rows()): in bfloat16 where the CPU has
        # its dot products (oneDNN's tiles, or shoal's panels, a gate_up's gated), else in
        # float32 panels, unless the blocks take every step.
        self.tiles: Bf16Linear | GatedBf16Linear | None = None
        self.panels: torch.Tensor | None = None
        if self.many_rows < NEVER:
            dequantized = self.blocks.dequantize()
            self.tiles = self._tiles(dequantized) if self.form.bf16 else None
            self.panels = self._pack(dequantized) if self.tiles is None else None

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by (for tests)."""
        return self.blocks.dequantize()

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return pack_panels(weight)

    def _tiles(self, weight: torch.Tensor) -> Bf16Linear | GatedBf16Linear:
        return Bf16Head(weight, self.bias) if self.head else Bf16Linear(weight, self.bias)


def float_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
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
    panels = _panels_of_rows(q.view(n, -1))
    return Q8Blocks(panels.view(*panels.shape[:2], -1), _scale_panels(d), n, k)


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
    pairs = _panels_of_rows(q.to(torch.uint8).view(n, -1))
    groups = pairs.view(*pairs.shape[:2], PAIRS, BLOCK)
    packed = groups[:, :, : PAIRS // 2] | (groups[:, :, PAIRS // 2 :] << 4)
    return Q4Blocks(packed.view(*pairs.shape[:2], -1), _scale_panels(d), _scale_panels(m), n)


def _padded(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    padded = torch.zeros(n, -(-k // BLOCK) * BLOCK)
    padded[:, :k] = weight
    return padded
