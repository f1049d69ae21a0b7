"""A request's grammar (json_schema, regex, ebnf, structural_tag) as a row constraint
(kernels/constraints.py): before each sample, every token the grammar does not allow next is
banned (-inf, from its matcher's bitmask); each token the row sampled moves the matcher on.

Invariants:
- It waits for its row's tokens: the mask depends on every token before, so a launch that
  samples the row first waits until they have all been advanced (on one stage, after its
  forward: the wait costs nothing when the token came back during it). The matcher's next
  mask is made as the token is told, on the completion thread, beside the next forward; the
  launch thread only adds it (a retracted row's replay makes none: only the last counts).
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


# A bitmask byte's eight tokens as 0 (allowed) or -inf (banned), lowest bit first: token
# 32k + 8i + j is bit j of byte i of word k (little-endian words, as xgrammar fills them)
_BYTE = torch.arange(256).view(-1, 1)
_BYTE_BIAS = torch.where(((_BYTE >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


class GrammarRow:
    """`device`: where the row's logits are. On the host the next step's mask is made ready
    as the row's token is told (`advance`, on the completion thread, while the launch thread
    runs the next forward): a float row of 0 and -inf the launch thread adds to the logits.
    On a GPU the bitmask itself goes over and xgrammar's kernel applies it."""

    waits_for_tokens = True

    def __init__(
        self, matcher: xgrammar.GrammarMatcher, vocab_size: int, device: torch.device
    ) -> None:
        import xgrammar

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # int32, on the host
        self.on_host = device.type == "cpu"
        if self.on_host:
            words = self.bitmask.shape[1]
            self.bytes = torch.empty(words * 4, dtype=torch.int64)
            self.bias_words = torch.empty(words * 4, 8)  # 0 where allowed, -inf where banned
            self.bias = self.bias_words.view(-1)[:vocab_size]
        self.ready = False  # the mask is the one for the next token
        self.live = False  # masked once: from then on each advance readies the next mask
        self.error: str | None = None  # why the row cannot go on
        self.told = False  # advance said it

    @classmethod
    def build(cls, params: SamplingParams, context: RowContext) -> GrammarRow | None:
        spec = params.grammar
        if spec is None:
            return None
        if context.grammars is None:
            raise RuntimeError("a request with a grammar reached an executor without grammars")
        return cls(context.grammars.matcher(spec), context.grammars.vocab_size, context.device)

    def _ready(self) -> None:
        """The mask of what the grammar allows next (RuntimeError: the matcher failed)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        if self.on_host:  # each byte's eight through the table: 40 µs at 49,152 tokens
            self.bytes.copy_(self.bitmask.view(torch.uint8).view(-1))
            torch.index_select(_BYTE_BIAS, 0, self.bytes, out=self.bias_words)
        self.ready = True

    def mask_(self, logits: torch.Tensor) -> None:
        self.live = True
        if self.error is not None or self.matcher.is_terminated():
            return  # the row has ended: whatever it samples now is discarded
        if not self.ready:
            try:
                self._ready()
            except RuntimeError as exc:  # the next advance ends the row with it
                self.error = f"the grammar's matcher failed: {exc}"
                return
        self.ready = False
        if self.on_host:
            logits.add_(self.bias)
            return
        import xgrammar

        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits.view(1, -1), bitmask)

    def advance(self, token_id: int) -> str | None:
        if self.error is None and not self.matcher.is_terminated():
            try:
                accepted = self.matcher.accept_token(token_id)
                if accepted and self.live and not self.matcher.is_terminated():
                    self._ready()  # off the launch thread: the next step only adds it
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
