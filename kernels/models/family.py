"""What shoal needs of one model family, as registry.py lists them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.kernels.loading.config import ModelConfig
    from shoal.kernels.models.llama import LlamaModel


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the config.json model_type values it serves
    # Every tensor its forward reads, by Hugging Face name, with its shape: the loader checks a
    # checkpoint against it before any weight is read.
    weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    # The forward: (config, weights by HF name, dtype, device, linear kind[, elementwise]).
    model: type[LlamaModel]
