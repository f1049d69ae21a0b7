"""Load a model: its folder, its family, its config, its checked weights and its tokenizer.

    load_model(model)
      folder   = model_folder(model)                   loading/loader.py (a GGUF converted)
      family   = family_of(model_type_of(config.json))  registry.py: an unknown one refused
      config   = ModelConfig.from_hf_config(config.json, family.traits, generation_config.json)
      weights  = read_weights(folder, config, family.weight_shapes(config))  loading/weights.py
      tokenizer = load_tokenizer(folder)

The family is resolved here, once, and passed down: loading/ reads files through what it is
given (the family's `Traits`, its weight shapes) and knows no family, so it never imports this
folder. Every load validates the checkpoint before it reads any tensor data: config.json field
by field, then every safetensors header against the family's shapes, and the shard index if
there is one; once read and cast, every value must be finite.

A weight update from disk (actors/executor/device_state.py) reads the new checkpoint with
`read_model_config` (its own family, so another family's config is read as that family's and
then refused for its architecture) and its tensors with `load_weights`, against the shapes of the
serving model's family.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.kernels.cache_files import raise_if_cancelled
from shoal.loading.checkpoint import CheckpointError
from shoal.loading.config import ModelConfig, model_type_of, read_config_files
from shoal.loading.loader import HFTokenizer, load_tokenizer, model_folder
from shoal.loading.weights import WeightShapes, read_weights
from shoal.models.family import Family
from shoal.models.registry import family_of


@dataclass(frozen=True, eq=False)
class LoadedModel:
    path: Path  # the HF-style folder actually loaded (the converted cache folder for a GGUF)
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF parameter names, see expected_weight_shapes
    tokenizer: HFTokenizer  # fast tokenizer with the model's chat template set


def load_model(
    model: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    progress: bool = True,
    cancel: threading.Event | None = None,
) -> LoadedModel:
    """Resolve `model` (loading/loader.py), then load its config, checked weights and
    tokenizer. A bad checkpoint raises ValueError naming the folder and what is wrong in it;
    StartCancelled when `cancel` is set meanwhile."""
    with model_folder(model, cache_dir, progress, cancel) as folder:
        raise_if_cancelled(cancel)
        try:
            family, config = _read_config(folder)
            weights = read_weights(folder, config, family.weight_shapes(config), dtype)
        except CheckpointError as exc:
            raise ValueError(f"model folder {folder}: {exc}") from exc
        raise_if_cancelled(cancel)
        tokenizer = load_tokenizer(folder)
    return LoadedModel(folder, config, weights, tokenizer)


def model_config(d: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """A config.json dict read through the family its model_type names (CheckpointError for
    an unsupported one, naming the supported ones), generation_config.json's bos/eos merged."""
    return ModelConfig.from_hf_config(d, family_of(model_type_of(d)).traits, generation)


def read_model_config(folder: Path) -> ModelConfig:
    """config.json, with generation_config.json's bos/eos merged in (eos ids are the union),
    every field checked (CheckpointError)."""
    return _read_config(folder)[1]


def expected_weight_shapes(config: ModelConfig) -> WeightShapes:
    """Every tensor the forward reads, by HF name, with its shape (the model family's)."""
    return family_of(config.model_type).weight_shapes(config)


def load_weights(
    folder: Path, config: ModelConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The folder's tensors for a model of `config` (its family's shapes), checked and cast
    to `dtype` (loading/weights.py; CheckpointError for a bad checkpoint)."""
    return read_weights(folder, config, expected_weight_shapes(config), dtype)


def _read_config(folder: Path) -> tuple[Family, ModelConfig]:
    config, generation = read_config_files(folder)
    family = family_of(model_type_of(config))
    return family, ModelConfig.from_hf_config(config, family.traits, generation)
