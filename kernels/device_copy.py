"""Host lists onto the device without synchronizing a CUDA stream.

A plain `torch.tensor(..., device="cuda")` synchronizes the current stream and would undo the
overlap of host work with the device's (actors/executor/streams.py): every host-to-device copy
of a step goes through `to_device` or `array_to_device` (pinned memory, non-blocking). On the
CPU it is no copy at all: the host tensor is the device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list as a tensor on `device`, without synchronizing a CUDA stream."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def array_to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`, as `to_device` (on the CPU it shares the array's memory)."""
    tensor = torch.from_numpy(host)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_many(
    fields: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Several int lists in one host-to-device copy, split back into views."""
    packed = to_device([x for field in fields for x in field], dtype, device)
    return list(packed.split_with_sizes([len(field) for field in fields]))
