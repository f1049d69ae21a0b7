"""Input limits every door shares (the Python API, OpenAI routes, /generate, sessions).

    limits = engine.options.input_limits()
    check_prompt_size(limits, prompt, messages)      # before any tokenization: cheap counts
    sampling.validate(vocab_size, limits)            # stops and logit_bias, counted first

Each check counts before it reads: a list's length before its entries, a string's length
before its content, so an oversized input is refused in time proportional to the limit, not
to the input. A refusal is a LimitExceeded (a ValueError) naming the field, the limit and the
option that sets it; the HTTP layer answers it with 400 and the field as `param`. docs/limits.md
lists every limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from shoal.results import ErrorCode, RequestError

TOO_MANY: ErrorCode = "array_above_max_length"  # OpenAI's codes for the same refusals
TOO_LONG: ErrorCode = "string_above_max_length"


class InputLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may carry. EngineOptions holds the same fields (settable per engine)."""

    max_stop_strings: int = 32
    max_stop_chars: int = 1024  # per stop string
    max_stop_token_ids: int = 256
    max_stop_regex: int = 16  # stop_regex patterns per request
    max_stop_regex_chars: int = 512  # per pattern
    max_prompt_chars: int = 2_000_000  # a text prompt, or all the messages' content together
    max_messages: int = 2048
    max_logit_bias: int = 300  # logit_bias entries per request
    max_token_ids_logprob: int = 64  # token_ids_logprob entries per request
    max_grammar_chars: int = 65536  # a json_schema, regex, ebnf or structural_tag

    def validate(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


class LimitExceeded(RequestError):
    """An input over a limit: a RequestError with its field and OpenAI's code for it. The
    message is the field's name then the detail, as every refusal of SamplingParams.validate
    is, so a door says it in its own name (RequestError.spoken)."""

    def __init__(self, field: str, detail: str, code: ErrorCode) -> None:
        super().__init__(detail, field, code, named=True)
        self.field: str = field  # always named


def check_count(count: int, limit: int, field: str, option: str) -> None:
    if count > limit:
        detail = f" has {count} entries, more than the limit of {limit} ({option})"
        raise LimitExceeded(field, detail, TOO_MANY)


def check_chars(length: int, limit: int, field: str, option: str, what: str = "") -> None:
    if length > limit:
        raise LimitExceeded(
            field,
            f"{what} is {length} characters, more than the limit of {limit} ({option})",
            TOO_LONG,
        )


def check_stops(
    limits: InputLimits,
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    stop_regex: Sequence[str] = (),
) -> None:
    """Stop strings and stop_regex patterns (how many, how long each) and stop token ids (how
    many)."""
    check_count(len(stop), limits.max_stop_strings, "stop", "max_stop_strings")
    for index, entry in enumerate(stop):
        if isinstance(entry, str):
            what = f" entry {index}" if len(stop) > 1 else ""
            check_chars(len(entry), limits.max_stop_chars, "stop", "max_stop_chars", what)
    num_ids = len(stop_token_ids)
    check_count(num_ids, limits.max_stop_token_ids, "stop_token_ids", "max_stop_token_ids")
    check_count(len(stop_regex), limits.max_stop_regex, "stop_regex", "max_stop_regex")
    for index, entry in enumerate(stop_regex):
        if isinstance(entry, str):
            what = f" entry {index}" if len(stop_regex) > 1 else ""
            limit = limits.max_stop_regex_chars
            check_chars(len(entry), limit, "stop_regex", "max_stop_regex_chars", what)


def check_prompt_size(
    limits: InputLimits,
    prompt: str | None,
    messages: Sequence[Mapping[str, Any]] | None,
    prompt_field: str = "prompt",
) -> None:
    """A text prompt's characters; the messages' count, then their content's characters."""
    if prompt is not None:
        check_chars(len(prompt), limits.max_prompt_chars, prompt_field, "max_prompt_chars")
    if messages is not None:
        check_count(len(messages), limits.max_messages, "messages", "max_messages")
        total = sum(message_chars(message) for message in messages)
        check_chars(total, limits.max_prompt_chars, "messages", "max_prompt_chars", "' content")


def message_chars(message: Any) -> int:
    """The characters of one chat message's string values, and of the strings in its lists
    (content parts): what the chat template will render."""
    if not isinstance(message, Mapping):
        return 0
    total = 0
    for value in message.values():
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, str):
                    total += len(part)
                elif isinstance(part, Mapping):
                    total += sum(len(v) for v in part.values() if isinstance(v, str))
    return total
