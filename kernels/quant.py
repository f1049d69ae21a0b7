"""int8 linears for `quantization="int8"` (CPU): int8 weights, activations in two int8 passes.

What is quantized how (y = x w.T + b, w: [N, K]):
    rotation    x and w are both multiplied along K by the same block-diagonal Hadamard matrix
                H (64 x 64 blocks, orthogonal, H H = I), so x H (w H).T == x w.T. It spreads a
                large feature of x (SmolLM2 has them) over its block, so the int8 steps of the
                other features stay fine. Data-free; the weight is rotated once at load.
    weight      int8, symmetric, one scale per output channel (max |row| / 127), rotated,
                quantized and packed once at construction and again at each `load`.
    activation  per row: divided by its own max / 63, then split into hi = round(.) (exact
                integers in -63..63) and lo = (. - hi) * 126 (in -63..63); both are rows of
                ONE int8 GEMM and recombined as (y_hi + y_lo / 126) * row scale: about 14 bits.
    out         float32 (the caller's dtype), bias added in float32.

The kernel: fbgemm's `quantized::linear_with_input_q_dq_qweight_dq_output_fp32` (u8 x s8 ->
int32 -> float32) on weights packed by `quantized::linear_prepack`, torch's x86 engine. Inputs
are fed with scale 1 and zero point 64, so every u8 value is in 1..127: on AVX2 without VNNI
fbgemm sums u8 x s8 pairs with `vpmaddubsw`, which saturates at int16; 255 * 127 * 2 overflows,
127 * 127 * 2 does not.

Why two passes: on SmolLM2 (bench/quality.py, 2,711 predictions) every one-pass activation
scheme missed the >= 97% top-1 agreement target (perplexity was within 3% from rotation on):
    torch.ao dynamic (per-tensor, 7-bit)          51.4%   ppl x2.38
    rotated, per-row, 7-bit (one pass)            94.1%   ppl x1.010
    same with 8-bit activations (saturates)       92.3%
    simulated ideal 8-bit per-row (no kernel)     96.3%   ppl x1.007
    rotated weights only, float activations       97.3%   ppl x1.0035  (the ceiling)
    this: rotated, two passes                     97.3%   ppl x1.0035
The price (2 threads, load ~1.5): the second pass doubles the GEMM's rows and small batches
pay ~10 small extra ops: a layer's linear runs at 0.2-0.6x the speed of float32 at M=1 and
0.4-1.1x at M = 16..512; lm_head (memory-bound) at 8.3x at M=1, 3.5x at M=16. End to end
(64 offline requests) 0.83x the tok/s of float32; one pass would be 1.30x. Weights take 4x
less memory.
Other kernels tried (oneDNN qlinear, torch._int_mm, _weight_int8pack_mm) have no fast path on
this CPU; per-shape timings are in bench/README.md.

Caveat: quantized tensor creation (`torch.quantize_per_channel`) is deprecated since torch 2.13
(pytorch issue 184982); oneDNN's `qlinear_prepack` on a plain int8 tensor is the fallback.
"""

from __future__ import annotations

import warnings

import torch

_QENGINES = ("x86", "fbgemm")
_MAX_BLOCK = 64
_MIN_SCALE = 1e-12  # a row of zeros still needs a positive scale
_HI_LEVELS = 63  # a row's max maps to +-63: u8 = 64 +- 63 stays in 1..127
_LO_GAIN = 126  # |x - round(x)| <= 0.5 maps to at most 63
_ZERO_POINT = 64


class Int8Linear:
    """y = x @ w.T + b with w int8 per output channel, x in two int8 passes per row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if torch.backends.quantized.engine not in _QENGINES:
            raise ValueError(
                f"quantization int8 needs torch's x86 or fbgemm quantized engine, "
                f"got {torch.backends.quantized.engine!r}"
            )
        if weight.device.type != "cpu":
            raise ValueError(f"quantization int8 runs on the CPU only, got {weight.device}")
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.hadamard = hadamard(rotation_block(self.in_features))
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = rotate(x.reshape(-1, self.in_features).float(), self.hadamard)
        n = rows.shape[0]
        row_max = torch.linalg.vector_norm(rows, float("inf"), dim=-1, keepdim=True)
        unit = row_max.clamp_min_(_MIN_SCALE).div_(_HI_LEVELS)  # [n, 1]
        scaled = rows / unit  # in -63..63
        stacked = torch.empty(2 * n, self.in_features)
        hi = torch.round(scaled, out=stacked[:n])
        torch.sub(scaled, hi, out=stacked[n:]).mul_(_LO_GAIN)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            stacked, 1.0, _ZERO_POINT, self.packed
        )
        out = torch.add(y[:n], y[n:], alpha=1.0 / _LO_GAIN).mul_(unit)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*shape[:-1], self.out_features).to(x.dtype)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Rotate, quantize and pack a weight of this linear's shape (a weight update)."""
        assert tuple(weight.shape) == (self.out_features, self.in_features), weight.shape
        rotated = rotate(weight.detach().float(), self.hadamard)
        self.packed = torch.ops.quantized.linear_prepack(quantize_weight(rotated), None)
        self.bias = None if bias is None else bias.detach().float().clone()

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by, rotated back (for tests)."""
        weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return rotate(weight.dequantize(), self.hadamard)  # H is its own inverse


def rotation_block(in_features: int) -> int:
    """The largest power of two up to 64 that divides in_features (1: no rotation)."""
    block = _MAX_BLOCK
    while in_features % block:
        block //= 2
    return block


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix over sqrt(n): symmetric and orthogonal, H H = I."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n**0.5


def rotate(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """[M, K] times block-diagonal(H, H, ...) along K."""
    block = h.shape[0]
    if block == 1:
        return t
    return (t.reshape(-1, block) @ h).view(t.shape)


def weight_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel scales: the largest |w| of each row maps to 127."""
    return (weight.abs().amax(dim=1) / 127.0).clamp_min(_MIN_SCALE)


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """A per-channel qint8 tensor (zero points 0) for fbgemm's prepack."""
    scales = weight_scales(weight).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # the deprecation is known (see the top of this file)
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor, torch.quantize_per_channel")
        return torch.quantize_per_channel(weight.contiguous(), scales, zero_points, 0, torch.qint8)
