"""How the forward multiplies by a weight: one `Linear` per projection, built at load.

    kind     class          where                 what a call does
    dense    DenseLinear    CUDA, and reference   F.linear on the weight as loaded
    packed   PackedLinear   CPU, float32          by row count: MKL's packed sgemm, oneDNN's
                                                  blocked layout, or F.linear (packed at load)
    int8     (quant.py)     CPU, opt-in           int8 weights per output channel (Hadamard-
                                                  rotated), activations per row in two 7-bit
                                                  passes of one fbgemm GEMM

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
_FEW_ROWS_HINT = 16
_MANY_ROWS = 128


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
    """float32 on the CPU, the weight kept in three forms, each used where it measured fastest
    against F.linear on a 2-core AVX2 EPYC with one thread (bench/README.md):

        rows     form                          one thread, against F.linear
        1        MKL's packed sgemm            SmolLM2's lm_head in about half the time
        2-127    oneDNN's blocked layout       1.2-1.8x faster at 4-64 rows
        128+     the plain weight (F.linear)   MKL's large-matrix sgemm, 10-15% ahead of oneDNN

    With two threads the gains shrink (the lm_head at 16 rows 1.2x, the layers' projections
    within 10%): a decode step is mostly bound by reading the weights. Three copies of every
    projection: memory traded for speed, as suits the small models a CPU serves."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = int(weight.shape[0])
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        num_rows = rows.shape[0]
        if num_rows == 1:
            y = torch.ops.mkl._mkl_linear(rows, self.one_row, self.weight, self.bias, 1)
        elif num_rows < _MANY_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.few_rows, self.bias, "none", [], "")
        else:
            y = F.linear(rows, self.weight, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.one_row = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)
        self.few_rows = torch.ops.mkldnn._reorder_linear_weight(self.weight, _FEW_ROWS_HINT)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and torch.backends.mkldnn.is_available()
    )


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
