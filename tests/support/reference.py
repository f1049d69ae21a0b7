"""The oracle of the parity tests: greedy continuations from transformers' `generate`.

reference = Reference(folder, eos_token_ids)
assert output_ids == reference.greedy(prompt_ids, max_new_tokens=12)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


class Reference:
    """Greedy continuations from transformers `generate(do_sample=False)`, memoized."""

    def __init__(self, folder: Path, eos_token_ids: Sequence[int]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        self.model.eval()
        self.eos = list(eos_token_ids)
        self.memo: dict[tuple[Any, ...], list[int]] = {}

    def greedy(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        ignore_eos: bool = False,
        logit_bias: Mapping[int, float] | None = None,
    ) -> list[int]:
        """logit_bias: added to each token's logit at every step (OpenAI's meaning), by HF's
        sequence_bias over single tokens."""
        bias = tuple(sorted((logit_bias or {}).items()))
        key = (tuple(prompt), max_new_tokens, ignore_eos, bias)
        if key not in self.memo:
            ids = torch.tensor([list(prompt)])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=None if ignore_eos else self.eos,
                    pad_token_id=self.eos[0] if self.eos else 0,
                    sequence_bias={(token,): value for token, value in bias} or None,
                )
            new = out[0, ids.shape[1] :].tolist()
            if not ignore_eos:
                for i, t in enumerate(new):
                    if t in self.eos:
                        new = new[: i + 1]
                        break
            self.memo[key] = new
        return self.memo[key]
