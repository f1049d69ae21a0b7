"""Each row's k largest logits' indices, through the compiled CPU op where it is built
(csrc/top_rows.cpp: one pass of vector compares a row against the k-th so far, where torch's
CPU topk of 8 over SmolLM2's 49152 logits took 2.6 ms for 64 rows on the 2-core AMD EPYC VM),
else torch's topk. The same values either way; the op orders equal ones by index, lower first.
"""

from __future__ import annotations

import torch

__all__ = ["top_indices"]

MOST = 64  # the op's largest k (csrc/top_rows.cpp)


def top_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits.topk(k, dim=-1).indices of logits [R, V], 1 <= k <= V: int64 [R, k] on logits'
    device, largest first."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and 1 <= k <= min(logits.shape[1], MOST)
        and hasattr(torch.ops.shoal_cpu, "top_rows")
    ):
        return torch.ops.shoal_cpu.top_rows(logits, k)
    return logits.topk(k, dim=-1).indices
