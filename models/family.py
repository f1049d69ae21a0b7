"""What shoal needs of one model family, as registry.py lists them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.kernels.elementwise import Elementwise
from shoal.kernels.linear import LinearKind
from shoal.loading.config import ModelConfig
from shoal.loading.traits import Traits
from shoal.loading.weights import WeightShapes
from shoal.models.decoder import DecoderModel, SourceFn
from shoal.models.layout import Part


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the config.json model_type values it serves
    # Every tensor its forward reads, by Hugging Face name, with its shape: a checkpoint is
    # checked against it before any weight is read (load.py passes it to loading/weights.py).
    weight_shapes: Callable[[ModelConfig], WeightShapes]
    source: SourceFn  # HF-named weights -> the decoder's layout (models/layout.py)
    # How its config.json reads (load.py passes them to ModelConfig.from_hf_config).
    traits: Traits = field(default_factory=Traits)
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
        f32_many_rows: int | None = None,
    ) -> DecoderModel:
        """The family's forward over these weights (HF names, checked); with `part`, only a
        pipeline stage's share of it. `f32_many_rows`: DecoderModel's (None: measured)."""
        return DecoderModel(
            config, weights, dtype, device, linear_kind, elementwise,
            source=self.source, part=part, f32_many_rows=f32_many_rows,
        )  # fmt: skip
