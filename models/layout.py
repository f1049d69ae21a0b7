"""The forward's view of a checkpoint: each layer's tensors in the layout the decoder multiplies
them, whatever the family calls them.

A family file (llama.py, qwen.py, gemma.py, phi3.py, mixtral.py) maps its Hugging Face names
onto a `ModelSource` (and says which names and shapes it reads); decoder.py builds and reloads
its weights from one, so every family shares one forward.

    ModelSource
      embed [V, hidden]     norm [hidden]     lm_head [V, hidden] (the embedding when tied)
      layers[i]: LayerSource
        norms     input, post_attention (+ pre_mlp, post_mlp for Gemma; + q, k for q/k norm)
        qkv       [(H + 2 Hkv) D, hidden] (+ bias)      o  [hidden, H D] (+ bias)
        mlp       DenseMLP: gate_up [2 I, hidden], down [hidden, I]
                  or ExpertMLP: router [E, hidden], gate_up [E, 2 I, hidden], down [E, hidden, I]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LinearWeights = tuple[torch.Tensor, torch.Tensor | None]  # weight, bias


@dataclass
class DenseMLP:
    gate_up: torch.Tensor  # gate rows first, then up
    down: torch.Tensor


@dataclass
class ExpertMLP:
    router: torch.Tensor
    gate_up: torch.Tensor  # [E, 2 I, hidden], gate rows first
    down: torch.Tensor  # [E, hidden, I]


@dataclass
class LayerNorms:
    input: torch.Tensor
    post_attention: torch.Tensor
    pre_mlp: torch.Tensor | None = None  # Gemma's sandwich
    post_mlp: torch.Tensor | None = None
    q: torch.Tensor | None = None  # q/k norm over each head (Qwen3, Gemma 3)
    k: torch.Tensor | None = None

    def present(self) -> list[torch.Tensor]:
        """The norms this layer has, in a fixed order."""
        every = (self.input, self.post_attention, self.pre_mlp, self.post_mlp, self.q, self.k)
        return [t for t in every if t is not None]


@dataclass
class LayerSource:
    norms: LayerNorms
    qkv: LinearWeights
    o: LinearWeights
    mlp: DenseMLP | ExpertMLP


@dataclass
class ModelSource:
    embed: torch.Tensor | None  # None: a pipeline stage after the first
    norm: torch.Tensor | None  # None (and no lm_head): a stage before the last
    lm_head: torch.Tensor | None  # `embed` itself when the head is tied
    layers: list[LayerSource]


@dataclass(frozen=True)
class Part:
    """The share of a model one pipeline stage runs: layers [start, stop), the embedding when
    it is the first stage, the final norm and the head when it is the last. A whole model is
    one part that is both."""

    layers: range
    first: bool
    last: bool

    @classmethod
    def whole(cls, num_layers: int) -> Part:
        return cls(range(num_layers), True, True)


def part_of(source: ModelSource, part: Part) -> ModelSource:
    """What of `source` one part holds."""
    return ModelSource(
        source.embed if part.first else None,
        source.norm if part.last else None,
        source.lm_head if part.last else None,
        source.layers[part.layers.start : part.layers.stop],
    )


def fused(weights: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """Rows of several projections stacked into one weight (or bias)."""
    return torch.cat([weights[name] for name in names])


def stacked(weights: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """Per-expert tensors stacked along a new first axis."""
    return torch.stack([weights[name] for name in names])
