"""A decode-only step through one C++ call for all of a model part's layers
(`csrc/decoder_layers.cpp`), where the Python forward (decoder.py) makes about twenty torch
calls a layer around the same kernels.

It runs the same compiled kernels in the same order, so the same bits; what it saves is the
dispatch and Python around them: 3.4 ms of an 11.0 ms one-sequence int8 step and 3.1 ms of a
23.5 ms float32 one on the 2-core VM (bench/README.md). It is built at load (and again after a
weight update, since a packed or int8 linear repacks into new tensors) only where every piece
has a compiled form:

    the model   standard layers (no q/k norm, no sandwich norms, RoPE over the whole head, no
                sliding window or soft-cap, a SiLU-gated dense MLP), the compiled element-wise
                ops, every linear packed float32 (in panels, gate_up in gated ones), int8
                (a gate_up's float32 or bfloat16 panels gated too) or bfloat16 (in oneDNN's
                layout, or in panels: bf16_linear.py, gate_up in gated ones: bf16_gated.py)
    the step    every token a decode, attended by the compiled kernel (`attention="cpu"`),
                fewer rows than the float32 linears take through oneDNN where a start chose
                it (kernels/f32_many_rows.py)

Anything else takes the Python forward, which stays the reference.
"""

from __future__ import annotations

import torch

from shoal.kernels.attention import AttentionMetadata
from shoal.kernels.batch import Attention
from shoal.kernels.bf16_gated import GatedBf16Linear
from shoal.kernels.bf16_linear import Bf16Linear
from shoal.kernels.elementwise import CompiledElementwise, Elementwise
from shoal.kernels.int8_gated import GatedInt8Linear
from shoal.kernels.linear import NEVER, GatedPanels, Linear, PackedLinear
from shoal.kernels.quant import Int8Linear, Q4Blocks, Q8Blocks
from shoal.loading.config import ModelConfig
from shoal.models.kv_pool import KVPool
from shoal.models.weights import DenseWeights, LayerWeights

# A linear's kind as decoder_layers.cpp numbers them, and the form of its last part.
FLOAT32, Q8, Q4, BF16 = 0, 1, 2, 3
PANELS, GATED, ONEDNN_BF16, BF16_PANELS, GATED_BF16_PANELS = 0, 1, 2, 3, 4


class FusedLayers:
    """The layers of a model part as one `DecoderLayers` (decoder_layers.cpp)."""

    def __init__(self, layers: object, python_from: int = NEVER) -> None:
        self.layers = layers
        # steps of this many rows or more take the Python forward: there the float32 linears
        # multiply through oneDNN (kernels/f32_many_rows.py), which the C++ layers do not
        self.python_from = python_from

    def takes(self, attention: Attention, tokens: int, rows: int | None = None) -> bool:
        """Whether this step is one the C++ layers run: decodes only, through the kernel, of
        fewer rows (`rows`: as the step stands for them; None: its tokens) than python_from."""
        if (tokens if rows is None else rows) >= self.python_from:
            return False
        if not isinstance(attention, AttentionMetadata):
            return False
        fused = attention.kernel_decodes
        return (
            fused is not None
            and attention.store_kernel is not None
            and not attention.decodes
            and not attention.extends
            and int(fused.token_index.numel()) == tokens
        )

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionMetadata,
        kv: KVPool,
        rows: int | None = None,
    ) -> torch.Tensor:
        """h [T, hidden], updated in place and returned; cos, sin [T, head_dim]; `rows`: the
        rows the step stands for (DecoderModel.run_layers; None: its T)."""
        fused = attention.kernel_decodes
        assert fused is not None
        return self.layers.forward(  # type: ignore[attr-defined]
            h, cos, sin, kv.k, kv.v, attention.slot_mapping, fused.page_ids, fused.seq_lens,
            fused.token_index, attention.page_size, int(h.shape[0]) if rows is None else rows,
        )  # fmt: skip


def fused_layers(
    config: ModelConfig,
    layers: list[LayerWeights],
    windows: tuple[int | None, ...],
    elementwise: Elementwise,
    scale: float,
) -> FusedLayers | None:
    """The part's layers as one C++ call, or None where some piece has no compiled form."""
    if not registered():
        return None
    if not isinstance(elementwise, CompiledElementwise) or not standard(config, windows):
        return None
    tensors: list[torch.Tensor] = []
    layout: list[int] = []
    many_rows = NEVER  # int8's threshold, one for the model's linears (none: unused)
    python_from = NEVER  # float32's oneDNN threshold (FusedLayers.python_from)
    for layer in layers:
        norms = layer.norms
        if norms.q is not None or norms.pre_mlp is not None or norms.post_mlp is not None:
            return None
        if not isinstance(layer.mlp, DenseWeights):
            return None
        tensors += [norms.input, norms.post_attention]
        for linear in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down):
            form = kernel_form(linear)
            if form is None:
                return None
            kind, parts, bias, last = form
            if isinstance(linear, Int8Linear):
                many_rows = linear.many_rows
            if isinstance(linear, PackedLinear | GatedPanels):
                python_from = min(python_from, linear.many_from)
            tensors += parts if bias is None else [*parts, bias]
            layout += [kind, linear.out_features, int(bias is not None), last]
    built = torch.classes.shoal_cpu.DecoderLayers(
        tensors, layout, config.num_heads, config.num_kv_heads, config.head_dim,
        config.rms_norm_eps, scale, many_rows,
    )  # fmt: skip
    return FusedLayers(built, python_from)


def registered() -> bool:
    """Whether the compiled kernels (cpu_kernels.py) are loaded, with their `DecoderLayers`."""
    try:
        torch.classes.shoal_cpu.DecoderLayers  # noqa: B018 (raises when not registered)
    except RuntimeError:
        return False
    return True


def standard(config: ModelConfig, windows: tuple[int | None, ...]) -> bool:
    """Layers the C++ forward computes as transformers does."""
    rotary = config.rotary_dim or config.head_dim
    return (
        rotary == config.head_dim
        and config.sliding_rope is None
        and all(w is None for w in windows)
        and config.attn_softcap is None
        and config.activation == "silu"
    )


def kernel_form(
    linear: Linear,
) -> tuple[int, list[torch.Tensor], torch.Tensor | None, int] | None:
    """(kind, parts, bias, the last part's form) as decoder_layers.cpp takes a linear, or None
    without one. The last part is what the linear multiplies by at every row count (float32,
    bf16) or from int8_rows.many_rows() rows on (int8): float32 panels, gated panels, a bfloat16
    weight in oneDNN's layout, or bfloat16 panels, plain or gated (an empty tensor where int8's
    blocks take every step)."""
    if isinstance(linear, PackedLinear) and linear.panels is not None:
        return FLOAT32, [linear.panels], linear.bias, PANELS
    if isinstance(linear, GatedPanels):
        return FLOAT32, [linear.panels], None, GATED
    if isinstance(linear, GatedBf16Linear):
        return BF16, [linear.panels], None, GATED_BF16_PANELS
    if isinstance(linear, Bf16Linear):
        form = bf16_form(linear)
        return None if form is None else (BF16, [form[0]], linear.bias, form[1])
    if isinstance(linear, Int8Linear):
        if linear.tiles is not None:
            tiles = bf16_form(linear.tiles)
            if tiles is None:
                return None
            many, last = tiles
        else:  # float32 panels, or none where the blocks take every step (int8_rows.py)
            many = linear.panels if linear.panels is not None else torch.empty(0)
            last = GATED if isinstance(linear, GatedInt8Linear) else PANELS
        blocks = linear.blocks
        if isinstance(blocks, Q4Blocks):
            return Q4, [blocks.q, blocks.d, blocks.m, many], linear.bias, last
        if isinstance(blocks, Q8Blocks):
            return Q8, [blocks.q, blocks.d, many], linear.bias, last
    return None


def bf16_form(linear: Bf16Linear | GatedBf16Linear) -> tuple[torch.Tensor, int] | None:
    """A bfloat16 linear's weight as decoder_layers.cpp takes it and its form: its panels
    (bf16_panels.cpp; gated ones for a gated gate_up), or its weight in oneDNN's layout; None
    for torch's `F.linear`."""
    if isinstance(linear, GatedBf16Linear):
        return linear.panels, GATED_BF16_PANELS
    if linear.panels is not None:
        return linear.panels, BF16_PANELS
    if linear.onednn and linear.weight is not None:
        return linear.weight, ONEDNN_BF16
    return None
