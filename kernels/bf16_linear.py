"""bfloat16 weights on the CPU, multiplied by the matrix units (`dtype="bfloat16"` on the CPU,
the default where the CPU has AMX or AVX512-BF16; resolve_options.py).

The weight is held in bfloat16 in oneDNN's blocked layout for its matmul, packed once at load;
a call rounds x to bfloat16, multiplies (AMX tiles where the CPU has them, AVX512-BF16 dot
products where it has those) and gives the product back in float32, the bias added in float32.
Everything around the matmuls (the residual stream, norms, RoPE, attention, the KV cache)
stays float32, so the only rounding is of the matmuls' inputs and products to bfloat16, as a
bfloat16 engine rounds them.

On a CPU with AVX512-BF16's dot products and no AMX tiles (the AMD EPYC of bench/README.md),
the weight is packed instead in panels of 16 channels for the compiled `bf16_panel_linear`
(csrc/bf16_panels.cpp): x rounded to bfloat16 as above, the products summed in float32 and
never rounded (oneDNN rounds them to bfloat16), faster than oneDNN's matmul there from one row
to 64 and level from 256 to 1024 (SmolLM2's 30 layers from memory, 2 threads: 1 row 7.1-9.4
ms against 13.4-14.3, 16 rows 12.1-16.9 against 16.5-19.3, 64 rows 36.5-46.4 against
42.0-49.4; bench/README.md). With AMX, oneDNN's matmul on the tiles.

On a CPU oneDNN has no bfloat16 kernel for (AVX2 only), a call multiplies in bfloat16 through
`F.linear`, correct and slow: resolve_options.py takes float32 by default there.

Measured on the Intel Xeon (AMX) of bench/README.md, SmolLM2's 30 layers of projections,
2 threads (bench/linear_kinds.py): 16 rows 6.8 ms against 17.8 for oneDNN float32 and 20.7 for
shoal's float32 panels, 64 rows 12.5 against 76.0 and 74.9, 256 rows 33.3 against 212 and 261;
offline, 298 output tokens a second against float32's 140.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.top_indices import top_indices

# oneDNN's packing takes the expected number of rows as a hint; any number works at call time.
_ROWS_HINT = 16


def onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (AVX512-BF16, AMX, or AVX-512's
    emulation: torch checks the same)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def amx_bf16() -> bool:
    """Whether oneDNN's bfloat16 matmuls run on the matrix tiles here (AMX; torch checks that
    the OS has enabled them)."""
    return onednn_bf16_available() and torch.cpu._is_amx_tile_supported()


# Candidates of a row whose logits a head computes again in float32 (Bf16Head)
HEAD_CANDIDATES = 8
PANEL = 16  # output channels a bfloat16 panel (csrc/bf16_panels.cpp)


def bf16_panels_available() -> bool:
    """Whether a bfloat16 linear multiplies through the compiled panels here: the kernels are
    loaded (cpu_kernels.py) and the CPU has AVX512-BF16's dot products and no AMX tiles."""
    if not hasattr(torch.ops.shoal_cpu, "bf16_panel_linear"):
        return False
    return bool(torch.ops.shoal_cpu.bf16_panels_supported()) and not amx_bf16()


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K even) -> [ceil(N / 16), K / 2, 32] bfloat16: panel p's pair i holds
    channel 16 p + j's weights 2 i and 2 i + 1 at 2 j and 2 j + 1, channels past N zero."""
    n, k = weight.shape
    count = -(-n // PANEL)
    padded = torch.zeros(count * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach().to(torch.bfloat16)
    pairs = padded.view(count, PANEL, k // 2, 2).transpose(1, 2)
    return pairs.contiguous().view(count, k // 2, 2 * PANEL)


class Bf16Linear:
    """x w.T + b with w in bfloat16: [.., K] float32 -> [.., N] float32. Its form: compiled
    panels (`panels` set: bf16_panels_available() and K even), else oneDNN's matmul (`onednn`),
    else torch's bfloat16 `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = int(weight.shape[0])
        self.use_panels = bf16_panels_available() and int(weight.shape[1]) % 2 == 0
        self.onednn = not self.use_panels and onednn_bf16_available()
        self.load(weight, bias)

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x float32 (rounded to bfloat16 here) or already bfloat16; one kernel at every size
        (`rows` unused)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.panels is not None:
            if flat.dtype not in (torch.float32, torch.bfloat16):
                flat = flat.float()
            out = torch.empty(flat.shape[0], self.out_features)
            torch.ops.shoal_cpu.bf16_panel_linear(flat.contiguous(), self.panels, self.bias, out)
            return out.view(*shape[:-1], self.out_features)
        y = self.product(flat)
        out = y.float() if self.bias is None else torch.add(self.bias, y)
        return out.view(*shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] times the weight, in bfloat16 (no bias): [T, N] bfloat16, as oneDNN
        gives it (bf16_mlp.py hands it to the next matmul without a float32 copy). Not in the
        panels' form, whose products stay float32."""
        if self.weight is None:
            raise RuntimeError(
                "Bf16Linear.product: in the panels' form the products are float32; call the "
                "linear itself"
            )
        rows = rows.to(torch.bfloat16)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(rows, self.weight, None, "none", [], "")
        return F.linear(rows, self.weight)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = None if bias is None else bias.to(torch.float32, copy=True).contiguous()
        self.panels: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if self.use_panels:
            self.panels = pack_bf16_panels(weight)
            return
        plain = weight.detach().to(torch.bfloat16).contiguous()
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(plain, _ROWS_HINT) if self.onednn else plain
        )


class Bf16Head(Bf16Linear):
    """The lm_head: bfloat16 on the matrix units for every logit, then each row's
    HEAD_CANDIDATES highest computed again from the float32 weight and x, exactly. The
    product's rounding to bfloat16 moves a logit of ~20 by up to 0.06, which flipped 2.2% of
    SmolLM2's teacher-forced top-1 choices against float32 (bench/quality.py, the whole text:
    97.79%); with the top 8 (or 4, or 16: the same) exact, 99.23%, 99.34%, 98.97% and 99.30%
    agree at chunks of 8, 16, 64 and 512 rows, the rest from the layers' own rounding. The
    greedy choice and the top logprobs come from float32 logits.
    Holds the float32 weight too (for a tied head, the embedding itself)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.exact = weight
        super().__init__(weight, bias)

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        logits = super().__call__(x)
        inputs = x.reshape(-1, x.shape[-1]).float()
        flat = logits.view(-1, self.out_features)
        top = top_indices(flat, min(HEAD_CANDIDATES, self.out_features))
        exact = torch.bmm(self.exact[top], inputs.unsqueeze(2)).squeeze(2)
        if self.bias is not None:
            exact += self.bias[top]
        flat.scatter_(-1, top, exact)
        return logits

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.exact = weight.detach().float()
        super().load(weight, bias)
