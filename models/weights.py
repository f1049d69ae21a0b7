"""A model's weights as the decoder multiplies them, built from a family's `ModelSource`
(layout.py) and reloaded from one on a weight update: norms and the embedding as plain tensors
(Gemma's norms as 1 + w), projections as `Linear`s of the engine's kind (linear.py), each
mixture-of-experts layer as an `Experts` (moe.py).

`tensors()`, `linears()` and `experts()` walk them in a fixed order, the order
`plain_tensors`, `linear_weights` and `expert_weights` give a new source's, so a reload copies
each into its own. A float32 model's first build measures whether its layers' steps of many
rows take oneDNN instead of the panels (kernels/f32_many_rows.py); its rebuilds keep that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shoal.kernels.f32_many_rows import onednn_from, take_many_rows
from shoal.kernels.linear import NEVER, Linear, LinearKind, make_linear
from shoal.kernels.moe import Experts
from shoal.loading.config import ModelConfig
from shoal.models.layout import DenseMLP, ExpertMLP, LayerNorms, ModelSource

if TYPE_CHECKING:
    from shoal.models.fused_layers import FusedLayers  # which builds on these weights


@dataclass
class DenseWeights:
    gate_up: Linear
    down: Linear


@dataclass
class LayerWeights:
    norms: LayerNorms
    qkv: Linear
    o: Linear
    mlp: DenseWeights | Experts


@dataclass
class ModelWeights:
    layers: list[LayerWeights]
    embed: torch.Tensor | None  # a pipeline stage holds only its part (layout.Part)
    norm: torch.Tensor | None
    lm_head: Linear | None  # built from the embedding when tied
    # from how many rows the float32 layer linears multiply through oneDNN (NEVER: never;
    # kernels/f32_many_rows.py)
    f32_many_rows: int = NEVER

    def tensors(self) -> list[torch.Tensor]:
        """The plain tensors (norms, embedding), in a fixed order."""
        out = [t for t in (self.embed, self.norm) if t is not None]
        for layer in self.layers:
            out += layer.norms.present()
        return out

    def experts(self) -> list[Experts]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, Experts)]

    def linears(self) -> list[Linear]:
        out = [] if self.lm_head is None else [self.lm_head]
        for layer in self.layers:
            out += [layer.qkv, layer.o]
            if isinstance(layer.mlp, DenseWeights):
                out += [layer.mlp.gate_up, layer.mlp.down]
        return out


@dataclass
class StagedWeights:
    """A weight update's new weights for one model part, ready to serve (`DecoderModel.stage`):
    either rebuilt whole (packed and int8 linears) or, to be copied in place, the host tensors
    in the order `ModelWeights` walks its own."""

    rebuilt: ModelWeights | None = None
    fused: FusedLayers | None = None
    plain: list[torch.Tensor] = field(default_factory=list)
    linears: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def plain_tensors(config: ModelConfig, source: ModelSource) -> list[torch.Tensor]:
    """The source's tensors in the order of `ModelWeights.tensors`, norms as the forward
    multiplies them (1 + w for Gemma's)."""
    plus = 1.0 if config.norm_plus_one else 0.0
    out = [] if source.embed is None else [source.embed]
    if source.norm is not None:
        out.append(source.norm + plus)
    for layer in source.layers:
        out += [t + plus for t in layer.norms.present()]
    return out


def expert_weights(source: ModelSource) -> list[ExpertMLP]:
    """The source's expert layers in the order of `ModelWeights.experts`."""
    return [layer.mlp for layer in source.layers if isinstance(layer.mlp, ExpertMLP)]


def linear_weights(source: ModelSource) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The source's linears in the order of `ModelWeights.linears`."""
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    if source.lm_head is not None:
        out.append((source.lm_head, None))
    for layer in source.layers:
        out += [layer.qkv, layer.o]
        if isinstance(layer.mlp, DenseMLP):
            out += [(layer.mlp.gate_up, None), (layer.mlp.down, None)]
    return out


def build_weights(
    config: ModelConfig,
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    kind: LinearKind,
    f32_many_rows: int | None = None,
) -> ModelWeights:
    """The forward's weights. `f32_many_rows`: from how many rows float32 panel linears take
    oneDNN (kernels/f32_many_rows.py; NEVER: never), None: measured here (a first build; a
    weight update keeps what the first measured)."""

    def own(t: torch.Tensor) -> torch.Tensor:
        # Always a copy: later loads write into these tensors, never into the caller's.
        return t.to(device=device, dtype=dtype, copy=True)

    plain = iter([own(t) for t in plain_tensors(config, source)])
    embed = None if source.embed is None else next(plain)
    norm = None if source.norm is None else next(plain)
    layers = []
    gated = config.activation == "silu"  # a dense MLP's gate_up is SiLU-gated
    many_rows = None
    if kind == "int8":  # decided once for the model's linears (reading the CPU's features)
        from shoal.kernels import int8_rows

        many_rows = int8_rows.many_rows()

    def linear(
        weight: torch.Tensor, bias: torch.Tensor | None, gate_up: bool = False, head: bool = False
    ) -> Linear:
        # In the order of `linear_weights`, which a reload walks.
        if embed is not None and weight is source.embed and kind in ("dense", "bf16"):
            # tied: the embedding itself (bf16: its float32 rows, the head's exact top logits)
            return make_linear(kind, embed, None, head=head)
        own_bias = None if bias is None else own(bias)
        gated_up = gate_up and gated
        return make_linear(kind, own(weight), own_bias, gated_up, head, many_rows)

    lm_head = None if source.lm_head is None else linear(source.lm_head, None, head=True)
    for layer in source.layers:
        n = layer.norms
        input_norm, post_attention = next(plain), next(plain)
        optional = (n.pre_mlp, n.post_mlp, n.q, n.k)
        pre_mlp, post_mlp, q, k = (None if t is None else next(plain) for t in optional)
        norms = LayerNorms(input_norm, post_attention, pre_mlp, post_mlp, q, k)
        qkv, o = linear(*layer.qkv), linear(*layer.o)
        mlp: DenseWeights | Experts
        if isinstance(layer.mlp, ExpertMLP):
            assert config.moe is not None
            router, gate_up, down = (
                own(t) for t in (layer.mlp.router, layer.mlp.gate_up, layer.mlp.down)
            )
            moe = config.moe
            mlp = Experts(
                router, gate_up, down, moe.top_k, moe.normalize,
                float32_weights=moe.float32_weights,
            )  # fmt: skip
        else:
            mlp = DenseWeights(
                linear(layer.mlp.gate_up, None, gate_up=True), linear(layer.mlp.down, None)
            )
        layers.append(LayerWeights(norms, qkv, o, mlp))
    weights = ModelWeights(layers, embed, norm, lm_head)
    if kind == "packed":
        in_layers = weights.linears()[0 if lm_head is None else 1 :]
        if f32_many_rows is None:
            f32_many_rows = onednn_from(in_layers)
        take_many_rows(in_layers, f32_many_rows)
        weights.f32_many_rows = f32_many_rows
    return weights
