"""Which detokenizer a request gets: the cheapest that gives `IncrementalDetokenizer`'s text
for its tokenizer, chosen once per tokenizer (docs/architecture.md, "Out: detokenize, stop
strings, the stream"):

    a Rust tokenizer (fast_decoder) whose decoder is ByteLevel  ->  ByteDetokenizer
    any other Rust tokenizer                                    ->  StreamDetokenizer
    a tokenizer that decodes its own way (clean-up, a subclass) ->  IncrementalDetokenizer
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer

from shoal.actors.tokenizer.byte_detokenize import ByteDetokenizer, ByteTables
from shoal.actors.tokenizer.detokenize import IncrementalDetokenizer, fast_decoder
from shoal.actors.tokenizer.stream_detokenize import StreamDetokenizer
from shoal.loading.hf_tokenizer import HFTokenizer


class Detokenizer(Protocol):
    """One request's generated ids into text: chunks that never end inside a character, the
    broken tail as U+FFFD at the flush; together decode(output ids) after the prompt."""

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class Detokenizers:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.decoder = fast_decoder(tokenizer)
        rust = self.decoder if isinstance(self.decoder, Tokenizer) else None
        self._rust = rust
        self._tables = ByteTables.of(rust) if rust is not None else None  # ~50 ms, once

    def open(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> Detokenizer:
        """A detokenizer for one request's output after `prompt_ids`."""
        if self._tables is not None:
            tables = self._tables
            return ByteDetokenizer(tables.skip if skip_special_tokens else tables.keep)
        if self._rust is not None:
            return StreamDetokenizer(self._rust, prompt_ids, skip_special_tokens)
        return IncrementalDetokenizer(self.decoder, prompt_ids, skip_special_tokens)
