"""int8 linears for `quantization="int8"` (CPU): int8 weights in blocks of 32, float32 activations.

What is quantized how (y = x w.T + b, w: [N, K]):
    weight      int8, symmetric, in blocks of 32 along K with one float32 scale each (the
                block's largest |w| maps to 127; GGUF's Q8_0 with a float32 scale), quantized
                once at construction and again at each `load`: 1.125 bytes per weight.
    activation  float32, as in the float model: nothing about x is rounded.
    out         float32, bias added in float32.

The kernel is `int8_linear` in csrc/linear.cpp (built with the other CPU kernels,
cpu_kernels.py): each weight becomes `q * scale` in float32, multiplied and summed in float32.
It is for the few-row steps that are bound by reading the weights: all of SmolLM2's
projections and its lm_head (2 threads, this 2-core AVX2 EPYC, bench/README.md) took 9-13 ms
at one row against 27-30 ms for oneDNN's float32, 13-16 ms against 35 at 4 rows, 44 against 55
at 16; at 64 rows and more it computes at 0.75-0.8x oneDNN's speed (the conversion costs).

Why weights only, per block (bench/quality.py, 2,711 teacher-forced predictions on SmolLM2):
the earlier per-channel weights with activations in two 7-bit passes of an fbgemm GEMM reached
97.3% top-1 agreement and ran at 0.2-0.6x float32 at one row; one-pass int8 activations
missed 97% (94.1% at best, rotated); float activations keep the error at the weights' alone.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per scale, along K (the kernel's kBlock)
_LEVELS = 127
_MIN_SCALE = 1e-12  # a block of zeros still needs a positive scale


class Int8Linear:
    """y = x @ w.T + b with w int8 in blocks of 32 along K, x and y float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.device.type != "cpu":
            raise ValueError(f"quantization int8 runs on the CPU only, got {weight.device}")
        if not hasattr(torch.ops.shoal_cpu, "int8_linear"):
            raise ValueError(
                "quantization int8 needs the compiled CPU kernels, and they are not loaded "
                "(kernels/cpu_kernels.py: load_cpu_kernels)"
            )
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        torch.ops.shoal_cpu.int8_linear(rows, self.weight, self.scales, self.bias, out)
        return out.view(*shape[:-1], self.out_features).to(x.dtype)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize a weight of this linear's shape (also a weight update)."""
        assert tuple(weight.shape) == (self.out_features, self.in_features), weight.shape
        self.weight, self.scales = quantize_blocks(weight.detach().float())
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by (for tests)."""
        return dequantize_blocks(self.weight, self.scales)


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and float32 scales [N, ceil(K / 32)]: w ~ q * scale of its block."""
    n, k = weight.shape
    blocks = -(-k // BLOCK)
    padded = torch.zeros(n, blocks * BLOCK)
    padded[:, :k] = weight
    grouped = padded.view(n, blocks, BLOCK)
    scales = (grouped.abs().amax(dim=2) / _LEVELS).clamp_min(_MIN_SCALE)
    q = torch.round(grouped / scales.unsqueeze(2)).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return q.view(n, blocks * BLOCK)[:, :k].contiguous(), scales.contiguous()


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q * scale of its block, in float32 [N, K], as the kernel forms each weight."""
    block_of = torch.arange(q.shape[1]) // BLOCK
    return q.float() * scales[:, block_of]
