"""How the forward multiplies by a weight: one `Linear` per projection, built at load.

    kind     class          where                 what a call does
    dense    DenseLinear    CUDA, and reference   F.linear on the weight as loaded
    packed   PackedLinear   CPU, float32          a compiled kernel on the weight packed at load
                                                  in panels of 16 channels (without the
                                                  kernels: oneDNN's matmul on its own layout)
             GatedPanels                          a SiLU-gated MLP's gate_up, with the kernels:
                                                  `silu_mul(x)` multiplies and activates at once
    bf16     Bf16Linear     CPU, bfloat16    weights in bfloat16, oneDNN's matmul on the matrix
             (bf16_linear.py)                     units (AMX), or compiled panels (AVX512-BF16);
                                                  x rounded to bfloat16, the product given back
                                                  in float32
             GatedBf16Linear                      a SiLU-gated gate_up in the panels' form:
             (bf16_gated.py)                      `silu_mul(x)` gives the down's bfloat16 input
    int8     Int8Linear     CPU, opt-in           weights in 4-bit or int8 blocks of 32 along K,
             (quant.py)                           activations rounded to int16, compiled kernels
                                                  (csrc/block_linear.cpp); from many rows on,
                                                  float32 panels of the dequantized weights
             GatedInt8Linear                      likewise a SiLU-gated gate_up, its panels
                                                  gated, with GatedPanels' `silu_mul(x)`

A call may say how many rows its step stands for (`rows`): int8 picks its kernel by it, so
that a verification's drafts take their row's decode kernel (kernels/batch.py: kernel_rows),
and so do float32's panels where oneDNN takes the steps of many rows (`take_many_rows`: on a
CPU where a start measured it faster there, kernels/f32_many_rows.py); bfloat16 and dense
have one kernel at every size and need not know.

`Linear.load` takes a new weight of the same shape (a weight update): a dense linear copies it
into the tensor it already holds (a captured CUDA graph keeps reading that tensor); a packed one
packs it again. Packed and dense give float32 results that may differ in the last bits (another
summation order), never more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from shoal.kernels.int8_rows import ManyRows

LinearKind = Literal["dense", "packed", "int8", "bf16"]

PANEL = 16  # output channels a panel (csrc/panels.h's kWidth)
# oneDNN's packing takes the expected number of rows as a hint; any number works at call time.
_ONEDNN_ROWS_HINT = 16
NEVER = 2**62  # a row count no step reaches: "never" for a kernel taken from many rows on


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor: ...

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None: ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight.copy_(weight)
        if self.bias is not None:
            assert bias is not None
            self.bias.copy_(bias)


def onednn_pack(weight: torch.Tensor, rows_hint: int = _ONEDNN_ROWS_HINT) -> torch.Tensor:
    """A float32 [N, K] weight in oneDNN's blocked layout for its matmul (`onednn_product`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)


def onednn_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [T, K] times a weight `onednn_pack` packed, plus the bias: [T, N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def many_rows(flat: torch.Tensor, rows: int | None, many_from: int) -> bool:
    """Whether x [T, K]'s step (`rows` rows; None: T) is oneDNN's (`take_many_rows`)."""
    return (flat.shape[0] if rows is None else rows) >= many_from


class PackedLinear:
    """float32 on the CPU, the weight packed once at load: with the compiled CPU kernels
    loaded, into panels of 16 output channels for `f32_linear` (csrc/linear.cpp, panels.h);
    without them, into oneDNN's blocked layout for its matmul.

    Measured on a 2-core AVX2 EPYC with two threads, all of SmolLM2's projections and its
    lm_head in a row (bench/README.md): oneDNN was the fastest of MKL's packed sgemm,
    `F.linear` and oneDNN at every row count tried (1 to 512), and `f32_linear` on panels beat
    oneDNN at every row count: 1 row 19.6 ms against 25.0, 16 rows 37.2 against 53.5, 64 rows
    111 against 142, 512 rows 848 against 961. Not on every CPU: on a Zen 3 EPYC oneDNN wins
    from ~128 rows, so where a model's first build measures that (f32_many_rows.py) its steps
    of many rows take oneDNN on a second copy of the weight (`take_many_rows`). The panels sum
    each output in k order: it may differ from `F.linear`'s (and oneDNN's) in the last bits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.many_from = NEVER  # steps of this many rows or more: oneDNN (take_many_rows)
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.panels is not None and not many_rows(flat, rows, self.many_from):
            y = self.panels_product(flat)
        else:
            assert self.packed is not None  # without the compiled kernels, or many rows
            y = onednn_product(flat, self.packed, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def panels_product(self, flat: torch.Tensor) -> torch.Tensor:
        """x [T, K] through the compiled kernel on the panels: [T, N]."""
        assert self.panels is not None
        y = torch.empty(flat.shape[0], self.out_features)
        torch.ops.shoal_cpu.f32_linear(flat.contiguous(), self.panels, self.bias, y)
        return y

    def plain_weight(self) -> torch.Tensor:
        """The weight [N, K] as it was loaded (exactly: the panels only permute it)."""
        assert self.panels is not None
        return unpack_panels(self.panels)[: self.out_features]

    def take_many_rows(self, from_rows: int) -> None:
        """Steps of `from_rows` rows or more multiply through oneDNN (f32_many_rows.py), on the
        weight in its layout too; the panels keep the others."""
        self.many_from = from_rows
        self.packed = onednn_pack(self.plain_weight(), from_rows)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = None if bias is None else bias.contiguous()
        compiled = hasattr(torch.ops.shoal_cpu, "f32_linear")  # loaded: cpu_kernels.py
        self.panels = pack_panels(weight) if compiled else None
        self.packed = None
        if not compiled:
            self.packed = onednn_pack(weight)
        elif self.many_from < NEVER:
            self.packed = onednn_pack(weight, self.many_from)


class GatedPanels:
    """A SiLU-gated MLP's fused gate_up ([2I, K]: the gate's rows, then the up's), float32 on
    the CPU with the compiled kernels: packed in panels of 8 gate channels and their 8 up
    channels, so that `silu_mul(x)` is one op (`f32_silu_mul`, linear.cpp) that multiplies and
    activates while the tile is in registers, with the bits of `f32_linear` then `silu_mul`.
    The separate op wrote the [T, 2I] product and read it back: 0.5 s of a 25 s offline run
    here (bench/README.md). A call gives the product itself, [.., 2I], as any linear does."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert bias is None, "a gate_up with a bias stays a PackedLinear"
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.inter = self.out_features // 2
        self.many_from = NEVER  # steps of this many rows or more: oneDNN (take_many_rows)
        self.packed: torch.Tensor | None = None
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        y = self._onednn(flat, rows)
        if y is None:
            y = self.panels_product(flat)
        return y.view(*shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """silu(gate) * up: [.., K] -> [.., I]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        out = torch.empty(flat.shape[0], self.inter)
        y = self._onednn(flat, rows)
        if y is None:
            torch.ops.shoal_cpu.f32_silu_mul(flat, self.panels, out)
        else:  # the same activation as f32_silu_mul's epilogue (silu.h)
            torch.ops.shoal_cpu.silu_mul(y, out)
        return out.view(*shape[:-1], self.inter)

    def panels_product(self, flat: torch.Tensor) -> torch.Tensor:
        """x [T, K] through the compiled kernel on the gated panels: [T, 2I] (gate, then up)."""
        return gated_product(flat, self.panels, self.inter)

    def plain_weight(self) -> torch.Tensor:
        """The gate_up [2I, K] as it was loaded (exactly: the panels only permute it)."""
        return ungated(unpack_panels(self.panels).t(), self.inter).t()

    def take_many_rows(self, from_rows: int) -> None:
        """Steps of `from_rows` rows or more multiply through oneDNN (f32_many_rows.py), on the
        weight in its layout too, and activate after; the panels keep the others."""
        self.many_from = from_rows
        self.packed = onednn_pack(self.plain_weight(), from_rows)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert bias is None
        self.panels = pack_gated_panels(weight)
        if self.many_from < NEVER:
            self.packed = onednn_pack(weight, self.many_from)

    def _onednn(self, flat: torch.Tensor, rows: int | None) -> torch.Tensor | None:
        """The product [T, 2I] through oneDNN for a step of many rows, else None."""
        if self.packed is None or not many_rows(flat, rows, self.many_from):
            return None
        return onednn_product(flat, self.packed, None)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: each panel's 16 output channels side by side for every k
    (channels past N are zeros), the layout `f32_linear` reads."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """`pack_panels` undone: [P, K, 16] -> [P * 16, K] (the zero channels past N included)."""
    count, k, width = panels.shape
    return panels.transpose(1, 2).reshape(count * width, k)


def gated_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """[2I, K] (gate rows, then up rows) -> [ceil(I / 8) * 16, K]: every 16 rows gate channels
    8p .. 8p + 7 and then the same up channels (past I: zeros), so that panels of 16 packed from
    them are gated ones (float32 here, bfloat16 in bf16_gated.py)."""
    two_inter, k = gate_up.shape
    inter, half = two_inter // 2, PANEL // 2
    padded = torch.zeros(2, -(-inter // half) * half, k, dtype=gate_up.dtype)
    padded[:, :inter] = gate_up.detach().view(2, inter, k)
    return padded.view(2, -1, half, k).transpose(0, 1).reshape(-1, k)


def pack_gated_panels(gate_up: torch.Tensor) -> torch.Tensor:
    """[2I, K] -> [ceil(I / 8), K, 16]: `gated_rows` in panels, the layout `f32_silu_mul`
    reads."""
    return pack_panels(gated_rows(gate_up))


def ungated(y: torch.Tensor, inter: int) -> torch.Tensor:
    """A product over gated panels, [T, P * 16], as a plain gate_up's: [T, 2I] (gate, then up)."""
    count, half = y.shape[1] // PANEL, PANEL // 2
    halves = y.view(-1, count, 2, half).transpose(1, 2).reshape(-1, 2, count * half)
    return halves[:, :, :inter].reshape(-1, 2 * inter)


def gated_product(rows: torch.Tensor, panels: torch.Tensor, inter: int) -> torch.Tensor:
    """The product of gated panels as a plain gate_up's: [T, K] -> [T, 2I] (gate, then up)."""
    y = torch.empty(rows.shape[0], int(panels.shape[0]) * PANEL)
    torch.ops.shoal_cpu.f32_linear(rows, panels, None, y)
    return ungated(y, inter)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def make_linear(
    kind: LinearKind,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool = False,
    head: bool = False,
    many_rows: ManyRows | None = None,
) -> Linear:
    """A linear of that kind over a weight the caller hands over (it may be kept). `gated`:
    the weight is a SiLU-gated MLP's fused gate_up, packed as `GatedPanels` where it can be.
    `head`: the lm_head, whose bf16 form computes each row's top logits again in float32.
    `many_rows` (int8): int8_rows.many_rows() as the model's build asked it once."""
    if kind == "dense":
        return DenseLinear(weight, bias)
    if kind == "packed":
        if gated and bias is None and hasattr(torch.ops.shoal_cpu, "f32_silu_mul"):
            return GatedPanels(weight, bias)
        return PackedLinear(weight, bias)
    if kind == "bf16":
        from shoal.kernels.bf16_gated import GatedBf16Linear, gated_bf16_available
        from shoal.kernels.bf16_linear import Bf16Head, Bf16Linear

        if gated and bias is None and gated_bf16_available(int(weight.shape[1])):
            return GatedBf16Linear(weight, bias)
        return Bf16Head(weight, bias) if head else Bf16Linear(weight, bias)
    if kind == "int8":
        from shoal.kernels.int8_gated import GatedInt8Linear
        from shoal.kernels.quant import Int8Linear

        if gated and bias is None:
            return GatedInt8Linear(weight, bias, many_rows)
        return Int8Linear(weight, bias, head, many_rows)
    raise ValueError(f"unknown linear kind {kind!r}")
