"""A checkpoint folder's tensors, read and checked against the shapes its family expects.

The caller says what the forward reads: `expected`, every tensor by Hugging Face name with its
shape (a family's `weight_shapes(config)`, models/family.py). This module knows no family.

Every header is validated against `expected` before any tensor data is read
(checkpoint.check_entries); once read and cast, every value must be finite (a NaN or an
infinity in a weight gives every request NaN logits). A bad checkpoint raises CheckpointError
(a ValueError) saying what is wrong with which file, which is what lets a weight update from
disk refuse it and keep serving the old weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

import torch

from shoal.loading.checkpoint import CheckpointError, check_entries, read_tensor_entries
from shoal.loading.config import ModelConfig

# Every tensor the forward reads, by Hugging Face name, with its shape.
WeightShapes: TypeAlias = dict[str, tuple[int, ...]]

# Tensors some checkpoints carry that the forward never reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_weights(
    folder: Path, config: ModelConfig, expected: WeightShapes, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """All tensors of `expected` from the folder's safetensors files, cast to `dtype`.

    Every header is validated against `expected` first (CheckpointError); only then is tensor
    data read, and every value checked finite once cast (CheckpointError). The result owns its
    memory (copied out of the mmap), so the files may be replaced later, as a trainer does when
    it writes the next checkpoint over the last one.
    """
    from safetensors import safe_open

    entries = read_tensor_entries(folder)
    for name in list(entries):
        if name.endswith(_IGNORED_SUFFIXES):
            del entries[name]
    if config.tie_word_embeddings:
        entries.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    check_entries(entries, expected)
    raw: dict[str, torch.Tensor] = {}
    for file_name in sorted({entry.file_name for entry in entries.values()}):
        with safe_open(str(folder / file_name), framework="pt") as f:
            for name, entry in entries.items():
                if entry.file_name == file_name:
                    raw[name] = f.get_tensor(name)
    check_weights(raw, expected)
    weights = {name: tensor.to(dtype, copy=True) for name, tensor in raw.items()}
    check_finite(weights)
    return weights


def check_weights(weights: dict[str, torch.Tensor], expected: WeightShapes) -> None:
    """Raise ValueError naming the first missing, mis-shaped or unexpected tensor."""
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
    unexpected = [name for name in weights if name not in expected]
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]}")


def check_finite(weights: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming the first tensor with a NaN or an infinity (a value past
    the range of the dtype it was cast to counts: it became one)."""
    for name, tensor in weights.items():
        if not bool(torch.isfinite(tensor).all()):
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise CheckpointError(
                f"tensor {name} holds values that are not finite in {dtype} (NaN or infinity)"
            )
