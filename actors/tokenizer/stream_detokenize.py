"""Incremental detokenization in Rust: the tokenizers library's streaming decoder
(`tokenizers.decoders.DecodeStream`) for a plain Rust tokenizer (`fast_decoder`) that is not
byte-level (detokenizers.py), one call a push, the bookkeeping in Rust.

DecodeStream runs `IncrementalDetokenizer`'s algorithm (detokenize.py): a window of the ids
of the text emitted last and the ids since, its prefix text, text emitted only when the
window's text does not end in U+FFFD, the window then slid to the ids just emitted. So a push
of one id gives the same chunk on both paths; a push of several ids that ends inside a
character emits nothing yet here (the old path emitted up to its last whole character), and
the concatenation is the same. The first window starts on the same prompt ids, dropped the
same way when their text ends inside a character. What this class keeps beside the stream is
what it cannot read back from it, for `flush` (a broken tail as U+FFFD):

    last: the ids of the text emitted last (the stream's window prefix)
    held: the ids pushed since, that completed no text (usually none)

A decoder whose text of a window does not start with its prefix's text (a rule across
tokens, e.g. a Replace after Fuse) makes DecodeStream raise; from then on the request's text
comes from `IncrementalDetokenizer`, started on the same window, as the old path would have.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from shoal.actors.tokenizer.detokenize import (
    PROMPT_CONTEXT_IDS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
)


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s chunks from DecodeStream: one Rust call a push."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_IDS) :])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character; output ids must not complete it
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._last: Sequence[int] = context
        self._held: list[int] = []
        self._fallback: IncrementalDetokenizer | None = None
        self._finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (often "")."""
        assert not self._finished, "push after flush"
        if self._fallback is not None:
            return self._fallback.push(token_ids)
        one = token_ids[0] if len(token_ids) == 1 else list(token_ids)
        try:
            text = self._stream.step(self._tokenizer, one)
        except Exception:  # DecodeStream's one error: the window's text left its prefix
            return self._fall_back(token_ids)
        if text is None:
            self._held.extend(token_ids)
            return ""
        if self._held:
            self._last, self._held = [*self._held, *token_ids], []
        else:
            self._last = token_ids
        return text

    def flush(self) -> str:
        """Finish: return whatever is left, a broken trailing character as U+FFFD."""
        if self._fallback is not None:
            return self._fallback.flush()
        if self._finished:
            return ""
        self._finished = True
        if not self._held:
            return ""
        prefix = self._decode(list(self._last))
        return self._decode([*self._last, *self._held])[len(prefix) :]

    def _fall_back(self, token_ids: Sequence[int]) -> str:
        """The old path from here on, started where the stream stood before these ids."""
        window = list(self._last)
        self._fallback = IncrementalDetokenizer(
            self._tokenizer, window, self._skip_special_tokens, num_context_ids=len(window)
        )
        return self._fallback.push([*self._held, *token_ids])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
