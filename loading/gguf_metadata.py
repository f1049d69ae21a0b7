"""What a GGUF file says, read through gguf's GGUFReader: metadata values, tensor names and
shapes, and tensors dequantized to float32.

    meta = GGUFMetadata(gguf.GGUFReader(path))
    meta.arch                                  "qwen3"  (general.architecture)
    meta.arch_value("attention.head_count")    32       (the key "qwen3.attention.head_count")
    meta.layer_int("attention.head_count_kv")  8        (a per-layer array must be uniform)
    meta.has_tensor("output.weight")           False    (tied embeddings)
    meta.tensor_values("rope_freqs.weight")    np.ndarray, float32

Nothing here knows an architecture: that is gguf_config.py (metadata) and gguf_tensors.py
(tensor names and values). A value of the wrong kind is a CheckpointError naming the key.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeAlias

import numpy as np

from shoal.loading.checkpoint import CheckpointError

# gguf.GGUFReader and its tensors. The gguf package is imported by name at run time, never
# statically: its vocab module imports transformers, and mypy run from the repo root would follow
# transformers' optional `import kernels` into shoal's own kernels/ package.
GGUFReader: TypeAlias = Any
GGUFTensor: TypeAlias = Any


class GGUFMetadata:
    """A read-only view of one GGUF file's metadata and tensors (see module doc)."""

    def __init__(self, reader: GGUFReader) -> None:
        self._reader = reader
        self._value_type = importlib.import_module("gguf").GGUFValueType
        self._tensors: dict[str, GGUFTensor] = {t.name: t for t in reader.tensors}
        arch = self.value("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError("GGUF metadata general.architecture is missing")
        self.arch: str = arch

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    @property
    def tensors(self) -> tuple[GGUFTensor, ...]:
        return tuple(self._tensors.values())

    def value(self, key: str, default: Any = None) -> Any:
        """A scalar or string metadata value, or `default` when the key is absent."""
        field = self._reader.fields.get(key)
        if field is None or not field.data:
            return default
        if field.types[0] == self._value_type.ARRAY:
            raise CheckpointError(f"GGUF metadata {key} is an array, expected a single value")
        return self._scalar(field.parts[field.data[0]], field.types[0])

    def values(self, key: str) -> list[Any] | None:
        """An array's elements (a scalar key reads as a one-element list); None when absent."""
        field = self._reader.fields.get(key)
        if field is None or not field.data:
            return None
        if field.types[0] != self._value_type.ARRAY:
            return [self.value(key)]
        element_type = field.types[-1]
        return [self._scalar(field.parts[index], element_type) for index in field.data]

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`value` of the key under the architecture's prefix, e.g. "llama.block_count"."""
        return self.value(f"{self.arch}.{key}", default)

    def layer_int(self, key: str, default: int | None = None) -> int | None:
        """An integer that llama.cpp may store once or once per layer (head counts): every
        layer must agree, since a converted config has one value for all of them."""
        found = self.values(f"{self.arch}.{key}")
        if not found:
            return default
        distinct = sorted({int(v) for v in found})
        if len(distinct) != 1:
            raise CheckpointError(
                f"GGUF metadata {self.arch}.{key} differs between layers ({distinct}), "
                "which no converted config can say"
            )
        return distinct[0]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_rows(self, name: str) -> int:
        """The first HF dimension of a tensor (its last GGUF one): vocab rows, output rows."""
        return int(self._tensors[name].shape[-1])

    def tensor_values(self, name: str) -> np.ndarray:
        return dequantized(self._tensors[name])

    def _scalar(self, part: Any, value_type: Any) -> Any:
        if value_type == self._value_type.STRING:
            return bytes(part).decode("utf-8")
        if value_type == self._value_type.FLOAT32:
            # The shortest decimal that is this float32: 1e-05, not 9.999999747378752e-06.
            return float(str(np.float32(part[0])))
        return part[0].item()


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as a writable, contiguous float32 array in HF axis order."""
    dequantize = importlib.import_module("gguf.quants").dequantize
    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = array.copy()  # F32 tensors come back as read-only views of the file
    return array
