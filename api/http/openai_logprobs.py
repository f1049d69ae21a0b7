"""Token log-probabilities in the two OpenAI shapes (chat's `content` list, completions' arrays).

Each token is reported with its exact bytes: a byte-level BPE token ("Ġthe", or one byte of a
multi-byte character) is mapped back through the GPT-2 byte table; a sentencepiece byte token
("<0xE2>") to its byte; anything else is decoded alone. The token string is those bytes as
UTF-8, with U+FFFD where a token holds only part of a character (its `bytes` stay exact).
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.api.http.openai_protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsOut,
    TokenLogprobOut,
    TopLogprob,
)
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.results import PromptLogprobs, TokenLogprob


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TokenBytes:
    """Bytes and display text of token ids for one tokenizer, memoized."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_decoder = _gpt2_byte_decoder() if "ByteLevel" in repr(decoder) else {}
        self.memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self.memo.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = (raw.decode("utf-8", errors="replace"), list(raw))
            self.memo[token_id] = found
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            if self.byte_decoder and all(ch in self.byte_decoder for ch in piece):
                return bytes(self.byte_decoder[ch] for ch in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
        text: str = self.tokenizer.decode([token_id])
        return text.encode("utf-8", errors="replace")


def chat_logprobs(
    items: Sequence[TokenLogprob] | None, token_bytes: TokenBytes, top: int
) -> ChatLogprobs | None:
    if items is None:
        return None
    content = []
    for item in items:
        token, raw = token_bytes(item.token_id)
        alternatives = []
        for token_id, logprob in item.top[:top]:
            alt, alt_raw = token_bytes(token_id)
            alternatives.append(TopLogprob(alt, logprob, alt_raw))
        content.append(TokenLogprobOut(token, item.logprob, raw, alternatives))
    return ChatLogprobs(content)


def completion_logprobs(
    items: Sequence[TokenLogprob] | None, token_bytes: TokenBytes, top: int, text_offset: int
) -> CompletionLogprobs | None:
    if items is None:
        return None
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    for item in items:
        token, _ = token_bytes(item.token_id)
        tokens.append(token)
        values.append(item.logprob)
        offsets.append(text_offset)
        text_offset += len(token)
        tops.append({token_bytes(t)[0]: lp for t, lp in item.top[:top]})
    return CompletionLogprobs(tokens, values, tops if top > 0 else None, offsets)


def echo_logprobs(
    prompt: PromptLogprobs | None,
    outputs: Sequence[TokenLogprob] | None,
    token_bytes: TokenBytes,
    top: int,
    output_offset: int,
) -> CompletionLogprobs:
    """Completions' logprobs with echo: the prompt's tokens first (the first one's logprob and
    top dict null, nothing precedes it), then the outputs', whose text offsets start at
    `output_offset` (the echoed prompt's length)."""
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    offset = 0
    if prompt is not None and prompt.first_token_id is not None:
        token, _ = token_bytes(prompt.first_token_id)
        tokens, values, offsets, tops = [token], [None], [0], [None]
        offset = len(token)
    parts = [
        completion_logprobs(prompt.items if prompt else (), token_bytes, top, offset),
        completion_logprobs(outputs or (), token_bytes, top, output_offset),
    ]
    for part in parts:
        assert part is not None
        tokens += part.tokens
        values += part.token_logprobs
        offsets += part.text_offset
        tops += part.top_logprobs or []
    return CompletionLogprobs(tokens, values, tops if top > 0 else None, offsets)


def vllm_prompt_logprobs(
    prompt: PromptLogprobs | None, token_bytes: TokenBytes, top: int
) -> PromptLogprobsOut | None:
    """vLLM's prompt_logprobs: null for position 0, then each position's prompt token and its
    `top` most likely alternatives, keyed by token id, each with its rank and text."""
    if prompt is None:
        return None
    out: PromptLogprobsOut = [None] if prompt.first_token_id is not None else []
    for item in prompt.items:
        ranked = [(item.token_id, item.logprob, item.rank)]
        ranked += [(t, lp, rank) for rank, (t, lp) in enumerate(item.top[:top], start=1)]
        entry: dict[str, PromptLogprob] = {}
        for token_id, logprob, rank in ranked:
            if str(token_id) not in entry:  # the prompt's token first, as vLLM has it
                entry[str(token_id)] = PromptLogprob(logprob, rank, token_bytes(token_id)[0])
        out.append(entry)
    return out
