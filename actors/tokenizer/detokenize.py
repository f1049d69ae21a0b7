"""Incremental detokenization that never emits half a UTF-8 character.

Each push decodes only a short window of ids (vLLM's prefix and read offsets; ids before the
window are dropped, so the prefix offset is always 0):

    window: | out0 out1 out2 | out3 out4 (new)
            ^0               ^read_offset
    prefix_text = decode(window[:read_offset])      already emitted
    full_text   = decode(window)
    emit full_text[len(prefix_text):] unless full_text ends with U+FFFD (a character still split
    across ids); then slide: window = window[read_offset:], read_offset = len(window).
    (A push of several ids that ends inside a character emits up to its last whole one.)

The first window starts on the last few prompt ids so the first generated token decodes in
context: sentencepiece-style decoders drop the leading space of a text's first token, and with
the prompt before it the space survives. A window edge only moves to a point where the
decoded text ended cleanly, so decode(window + rest) == decode(window) + decode(rest) for
byte-level tokenizers, and the concatenation of all output equals decode(output ids).
A run of ids that decodes to U+FFFD at every step (invalid bytes) widens the window until a
clean character arrives; real models leave such runs quickly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from shoal.loading.hf_tokenizer import HFTokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids the first window reaches back over: enough for a multi-byte character's context.
PROMPT_CONTEXT_IDS = 5


class Decoder(Protocol):
    """What this file needs of a tokenizer; transformers' PreTrainedTokenizerBase fits.

    (A Protocol rather than an import: mypy run from the repo root would otherwise follow
    transformers' optional `import kernels` into shoal's own kernels/ package.)
    """

    def decode(
        self, token_ids: list[int], /, skip_special_tokens: bool = ...
    ) -> str | list[str]: ...


# transformers' methods (by name: importing transformers here would lead mypy into its optional
# `import kernels`, see Decoder) that add nothing to the Rust tokenizer's own decode but spaces'
# clean-up.
PLAIN_DECODE = ("PreTrainedTokenizerBase.decode", "TokenizersBackend._decode")


def fast_decoder(tokenizer: HFTokenizer) -> Decoder:
    """The Rust tokenizer under a transformers fast tokenizer when transformers' `decode` would
    only wrap it (no clean-up of spaces, no subclass decoding its own way): the same text at
    about a third of the cost a call (SmolLM2: 1.2 against 4.1 us), twice a token a request.
    Anything else: the tokenizer itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kind = type(tokenizer)
    methods = (getattr(kind, "decode", None), getattr(kind, "_decode", None))
    plain = tuple(getattr(m, "__qualname__", "") for m in methods) == PLAIN_DECODE
    if backend is None or not plain or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer
    return cast(Decoder, backend)


class IncrementalDetokenizer:
    """Turns one request's generated ids into text, a chunk per push.

    Concatenating every push and the final flush gives the output text; a chunk never ends in
    the middle of a character, so U+FFFD only comes out when the ids really decode to it.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        num_context_ids: int = PROMPT_CONTEXT_IDS,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[max(0, len(prompt_ids) - num_context_ids) :])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; output ids must not complete it.
            self._ids, self._prefix_text = [], ""
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (often "")."""
        assert not self._finished, "push after flush"
        num_before = len(self._ids)
        self._ids.extend(token_ids)
        # Cut after the last new id whose text ends on a whole character: usually the last one,
        # but a push of several ids may end inside a character. Earlier ids were tried already.
        for end in range(len(self._ids), num_before, -1):
            text = self._decode(self._ids[:end])
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                return self._emit(text, end)
        return ""

    def _emit(self, text: str, end: int) -> str:
        """Emit text (the window's ids[:end] decoded) and slide the window to start at read."""
        new_text = text[len(self._prefix_text) :]
        del self._ids[: self._read_offset]
        self._read_offset = end - self._read_offset
        self._prefix_text = self._decode(self._ids[: self._read_offset])
        self._chunks.append(new_text)
        return new_text

    def flush(self) -> str:
        """Finish: return whatever is left, a broken trailing character as U+FFFD."""
        if self._finished:
            return ""
        self._finished = True
        new_text = self._decode(self._ids)[len(self._prefix_text) :]
        self._chunks.append(new_text)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        assert isinstance(text, str)
        return text
