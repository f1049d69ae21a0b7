"""How the forward multiplies by a weight: one `Linear` per projection, built at load.

    kind     class          where                 what a call does
    dense    DenseLinear    CUDA, and reference   F.linear on the weight as loaded
    packed   PackedLinear   CPU, float32          oneDNN's matmul on the weight in its blocked
                                                  layout (packed at load); up to 4 rows a
                                                  compiled kernel on the plain weight
    int8     (quant.py)     CPU, opt-in           weights in 4-bit or int8 blocks of 32 along K,
                                                  activations rounded to int16, compiled kernels
                                                  (csrc/block_linear.cpp)

`Linear.load` takes a new weight of the same shape (a weight update): a dense linear copies it
into the tensor it already holds (a captured CUDA graph keeps reading that tensor); a packed one
packs it again. Packed and dense give float32 results that may differ in the last bits (another
summation order), never more.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F

LinearKind = Literal["dense", "packed", "int8"]

# oneDNN's packing takes the expected number of rows as a hint; any number works at call time.
_ROWS_HINT = 16
FEW_ROWS = 4  # up to this many rows, a packed linear runs f32_linear when it can


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None: ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight.copy_(weight)
        if self.bias is not None:
            assert bias is not None
            self.bias.copy_(bias)


class PackedLinear:
    """float32 on the CPU: oneDNN's matmul on the weight reordered once into its blocked
    layout, and, when the compiled CPU kernels are loaded, `f32_linear` (csrc/linear.cpp) on
    the plain weight for steps of up to `FEW_ROWS` rows.

    Measured on a 2-core AVX2 EPYC with two threads, all of SmolLM2's projections in a row
    (bench/README.md): oneDNN was the fastest of MKL's packed sgemm, `F.linear` and oneDNN at
    every row count tried (1 to 512): at one row 1.25x MKL's packed form and 1.4x `F.linear`,
    at 16-64 rows 1.2-1.5x `F.linear`, at 128-512 rows 1.0-1.3x. At one to four rows, where a
    step is bound by reading the weights, `f32_linear` reads them faster still (one row 22 ms
    against 31, four rows 29 against 35), so the weight is kept twice: 1.08 GB for SmolLM2
    instead of 0.54. The two sum in different orders: results may differ in the last bits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = int(weight.shape[0])
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.weight is not None and rows.shape[0] <= FEW_ROWS and rows.stride(-1) == 1:
            y = torch.empty(rows.shape[0], self.out_features)
            torch.ops.shoal_cpu.f32_linear(rows, self.weight, self.bias, y)
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = None if bias is None else bias.contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)
        few_rows = hasattr(torch.ops.shoal_cpu, "f32_linear")  # loaded: cpu_kernels.py
        self.weight = weight.contiguous() if few_rows else None


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def make_linear(kind: LinearKind, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A linear of that kind over a weight the caller hands over (it may be kept)."""
    if kind == "dense":
        return DenseLinear(weight, bias)
    if kind == "packed":
        return PackedLinear(weight, bias)
    if kind == "int8":
        from shoal.kernels.quant import Int8Linear

        return Int8Linear(weight, bias)
    raise ValueError(f"unknown linear kind {kind!r}")
