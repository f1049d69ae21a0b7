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
        grammar: Any = None,
    ) -> list[int]:
        """logit_bias: added to each token's logit at every step (OpenAI's meaning), by HF's
        sequence_bias over single tokens. grammar: an xgrammar GrammarMatcher at its start
        (kernels/grammars.py), which bans what it does not allow next; generation then ends
        at EOS whatever ignore_eos says, as shoal's does."""
        bias = tuple(sorted((logit_bias or {}).items()))
        key = (tuple(prompt), max_new_tokens, ignore_eos, bias, id(grammar))
        if grammar is not None:
            key, ignore_eos = (), False  # a matcher is used up: never memoized
        if key not in self.memo or grammar is not None:
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
                    logits_processor=None
                    if grammar is None
                    else [GrammarMask(grammar, len(prompt))],
                )
            new = out[0, ids.shape[1] :].tolist()
            if not ignore_eos:
                for i, t in enumerate(new):
                    if t in self.eos:
                        new = new[: i + 1]
                        break
            if grammar is not None:
                return new
            self.memo[key] = new
        return self.memo[key]


class GrammarMask:
    """A transformers logits processor: -inf on what the matcher does not allow next, the
    matcher moved on by each token generated (after the prompt's `start` ids)."""

    def __init__(self, matcher: Any, start: int) -> None:
        import xgrammar

        self.matcher = matcher
        self.start = start
        self.bitmask: torch.Tensor | None = None
        self.apply = xgrammar.apply_token_bitmask_inplace
        self.allocate = xgrammar.allocate_token_bitmask

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.start:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        if self.bitmask is None:
            self.bitmask = self.allocate(1, scores.shape[1])
        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = scores.clone()
        self.apply(scores, self.bitmask)
        return scores
