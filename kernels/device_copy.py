"""Host lists onto the device without synchronizing a CUDA stream.

A plain `torch.tensor(..., device="cuda")` synchronizes the current stream and would undo the
overlap of host work with the device's (actors/executor/streams.py): every host-to-device copy
of a step goes through `to_device` (pinned memory, non-blocking). On the CPU it is a plain copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list as a tensor on `device`, without synchronizing a CUDA stream."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_many(
    fields: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Several int lists in one host-to-device copy, split back into views."""
    packed = to_device([x for field in fields for x in field], dtype, device)
    return list(packed.split([len(field) for field in fields]))
