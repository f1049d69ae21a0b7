"""What shoal needs of one model family, as registry.py lists them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.kernels.elementwise import Elementwise
from shoal.kernels.linear import LinearKind
from shoal.loading.config import ModelConfig
from shoal.loading.traits import Traits
from shoal.models.decoder import DecoderModel, SourceFn
from shoal.models.layout import Part


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the config.json model_type values it serves
    # Every tensor its forward reads, by Hugging Face name, with its shape: the loader checks a
    # checkpoint against it before any weight is read.
    weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    source: SourceFn  # HF-named weights -> the decoder's layout (models/layout.py)
    traits: Traits = field(default_factory=Traits)  # how its config.json reads
    tested: str = ""  # what the tests check of it (the README's table of families)

    def build(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        linear_kind: LinearKind = "dense",
        elementwise: Elementwise | None = None,
        part: Part | None = None,
    ) -> DecoderModel:
        """The family's forward over these weights (HF names, checked); with `part`, only a
        pipeline stage's share of it."""
        return DecoderModel(
            config, weights, dtype, device, linear_kind, elementwise, source=self.source, part=part
        )
