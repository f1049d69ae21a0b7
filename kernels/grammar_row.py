"""A request's grammar (json_schema, regex, ebnf, structural_tag) as a row constraint
(kernels/constraints.py): before each sample, every token the grammar does not allow next is
banned (-inf, from its matcher's bitmask); each token the row sampled moves the matcher on.

Invariants:
- It waits for its row's tokens: the mask depends on every token before, so a launch that
  samples the row first waits until they have all been advanced (the row gives up overlap;
  its neighbours keep theirs).
- Where the grammar is complete its only allowed tokens are the model's EOS ids (the matcher's
  stop tokens): the row ends there with "stop" (actors/scheduler/request.py, finish_reason),
  whatever ignore_eos says.
- A token the grammar refuses (nothing was left to allow: min_new_tokens banned the end it
  reached), or a matcher that fails (xgrammar's recursion limit on a pathological grammar),
  ends this row alone with an error (`advance` says why, once), never the step its
  neighbours share; every later call of the row is a no-op until its request is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shoal.params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

    from shoal.kernels.constraints import RowContext


class GrammarRow:
    waits_for_tokens = True

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        import xgrammar

        self.matcher = matcher
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # int32, on the host
        self.error: str | None = None  # why the row cannot go on
        self.told = False  # advance said it

    @classmethod
    def build(cls, params: SamplingParams, context: RowContext) -> GrammarRow | None:
        spec = params.grammar
        if spec is None:
            return None
        if context.grammars is None:
            raise RuntimeError("a request with a grammar reached an executor without grammars")
        return cls(context.grammars.matcher(spec), context.grammars.vocab_size)

    def mask_(self, logits: torch.Tensor) -> None:
        import xgrammar

        if self.error is not None or self.matcher.is_terminated():
            return  # the row has ended: whatever it samples now is discarded
        try:
            self.matcher.fill_next_token_bitmask(self.bitmask)
        except RuntimeError as exc:  # the next advance ends the row with it
            self.error = f"the grammar's matcher failed: {exc}"
            return
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits.view(1, -1), bitmask)

    def advance(self, token_id: int) -> str | None:
        if self.error is None and not self.matcher.is_terminated():
            try:
                accepted = self.matcher.accept_token(token_id)
            except RuntimeError as exc:
                self.error = f"the grammar's matcher failed: {exc}"
            else:
                if accepted:
                    return None
                self.error = (
                    f"the output cannot continue under its grammar: token {token_id} is not "
                    "allowed there (nothing was: min_new_tokens or a stop token ban left no "
                    "allowed token)"
                )
        if self.error is None or self.told:
            return None
        self.told = True
        return self.error
