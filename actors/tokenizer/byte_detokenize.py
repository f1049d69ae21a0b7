"""Incremental detokenization for a byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen):
each id's bytes from a table, joined by Python's incremental UTF-8 decoder. One table lookup
and one C call a token, no window, no decode of text already emitted.

A tokenizer whose decoder is exactly `decoders.ByteLevel` decodes ids as the Rust library
does (tokenizers/src/pre_tokenizers/byte_level.rs, `decode_chain`):

    bytes(id) = each character of the id's token through the byte-level alphabet, or, when
                one is outside it (an added token's text), the token's own UTF-8
    decode(ids) = b"".join(bytes(id) for id in ids, specials dropped when skipped, unknown
                  ids dropped).decode("utf-8", errors="replace")

and the incremental decoder gives that text in pieces: it holds the bytes of a character
still split across ids, so a chunk never ends inside a character, and U+FFFD comes out only
for bytes that are invalid whatever follows (as Rust's `from_utf8_lossy`, maximal subparts);
`flush` turns a broken tail into U+FFFD. The concatenation is decode(output ids); the prompt
needs no context (a byte-level decoder has no leading-space rule, and a prompt that ends
inside a character is not completed by the output, as in `IncrementalDetokenizer`). Where a
chunk ends may differ from the window's: text before a split character comes out at once.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders


class ByteTables:
    """Every id's bytes, with special tokens kept (`keep`) and skipped (`skip`)."""

    def __init__(self, keep: tuple[bytes, ...], skip: tuple[bytes, ...]) -> None:
        self.keep = keep
        self.skip = skip

    @staticmethod
    def of(tokenizer: Tokenizer) -> ByteTables | None:
        """The tables of a tokenizer whose decoder is exactly ByteLevel; None for any other."""
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            return None
        tokens = {i: token for token, i in tokenizer.get_vocab(with_added_tokens=False).items()}
        added = tokenizer.get_added_tokens_decoder()
        tokens.update((i, token.content) for i, token in added.items())  # added ones win
        alphabet, to_byte = byte_alphabet()
        keep = [b""] * (max(tokens, default=-1) + 1)  # ids of no token decode to nothing
        for i, token in tokens.items():
            in_alphabet = alphabet.issuperset(token)
            keep[i] = token.translate(to_byte).encode("latin-1") if in_alphabet else token.encode()
        skip = list(keep)
        for i, added_token in added.items():
            if added_token.special:
                skip[i] = b""
        return ByteTables(tuple(keep), tuple(skip))


def byte_alphabet() -> tuple[frozenset[str], dict[int, int]]:
    """GPT-2's byte-level alphabet (a printable character for each byte) and its inverse as a
    str.translate table (character to the byte's code point, for a latin-1 encode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: b for b in printable} | {b: 256 + n for n, b in enumerate(others)}
    return frozenset(chr(c) for c in chars.values()), {c: b for b, c in chars.items()}


class ByteDetokenizer:
    """One request's ids into text through its tokenizer's byte table (UTF-8 decoded as
    `codecs`' incremental decoder does, its buffering inline: one C call a push)."""

    def __init__(self, table: tuple[bytes, ...]) -> None:
        self._table = table
        self._held = b""  # the bytes of a character still split across ids
        self._finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (often "")."""
        assert not self._finished, "push after flush"
        table = self._table
        try:
            if len(token_ids) == 1:
                data = self._held + table[token_ids[0]]
            else:
                data = self._held + b"".join([table[i] for i in token_ids])
        except IndexError:  # an id past the tokenizer's (a padded vocabulary): no text
            data = self._held + b"".join([table[i] for i in token_ids if i < len(table)])
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._held = data[used:]
        return text

    def flush(self) -> str:
        """Finish: return whatever is left, a broken trailing character as U+FFFD."""
        if self._finished:
            return ""
        self._finished = True
        text, _ = codecs.utf_8_decode(self._held, "replace", True)
        return text
