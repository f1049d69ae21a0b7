"""An identity of a model's weights that survives restarts: what two disaggregated servers
compare before one uses the other's KV (docs/disaggregation.md).

    digest = weights_digest(loaded.weights, linear_kind)   # "w1-" + 24 hex digits

blake2b over every tensor, in name order: its name, dtype, shape, and a strided sample of at
most SAMPLE_ELEMENTS of its values (every element of a small tensor; the first, then every
numel // SAMPLE_ELEMENTS-th of a large one), plus whether the linears are int8 or bfloat16 (their
outputs differ from the dense ones'). It reads about SAMPLE_ELEMENTS values a tensor, so it takes
milliseconds even for an 8B model, and it is the same wherever the same checkpoint is loaded
with the same dtype and quantization: a restart, another machine. Other weights (another
checkpoint, a fine-tune, another dtype) differ in nearly every value and so in the sample. It
is not a checksum of the files: two checkpoints that differ in a few values only may share it.
"""

from __future__ import annotations

import hashlib

import torch

SAMPLE_ELEMENTS = 4096
VERSION = "w1"  # a change of the recipe changes this prefix


def weights_digest(weights: dict[str, torch.Tensor], linear_kind: str = "dense") -> str:
    digest = hashlib.blake2b(digest_size=12)
    digest.update(f"{VERSION};int8={linear_kind == 'int8'}".encode())
    if linear_kind == "bf16":  # bfloat16 linears over float32 weights: other outputs
        digest.update(b";bf16")
    for name in sorted(weights):
        tensor = weights[name].detach()
        digest.update(f";{name};{tensor.dtype};{tuple(tensor.shape)};".encode())
        flat = tensor.reshape(-1)
        stride = max(1, flat.numel() // SAMPLE_ELEMENTS)
        sample = flat[::stride][:SAMPLE_ELEMENTS].contiguous().cpu()
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return f"{VERSION}-{digest.hexdigest()}"
