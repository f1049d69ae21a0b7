"""OpenAI's logit_bias as a row constraint (kernels/constraints.py): each listed token's bias
added to its logit at every step, before the filters and temperature. Stateless: it never
waits for a row's earlier tokens, so the row keeps overlap."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shoal.kernels.device_copy import to_device
from shoal.params import SamplingParams

if TYPE_CHECKING:
    from shoal.kernels.constraints import RowContext


class LogitBias:
    """The bias of one request, on the device its row's logits are sampled on."""

    waits_for_tokens = False

    def __init__(self, bias: dict[int, float], device: torch.device) -> None:
        self.token_ids = to_device(list(bias), torch.int64, device)
        self.values = to_device(list(bias.values()), torch.float32, device)

    @classmethod
    def build(cls, params: SamplingParams, context: RowContext) -> LogitBias | None:
        return cls(params.logit_bias, context.device) if params.logit_bias else None

    def mask_(self, logits: torch.Tensor) -> None:
        logits.index_add_(0, self.token_ids, self.values)

    def advance(self, token_id: int) -> str | None:
        return None
