"""The session websocket's wire format (GET /v1/sessions/ws): one JSON object per text frame,
tagged by "type", decoded and encoded by msgspec.

client                                             server
{"type": "open", "timeout_s"?, "max_tokens"?}  ->  {"type": "opened", "session_id"}
{"type": "turn", one of "text" | "input_ids"   ->  {"type": "delta", "text", "token_ids",
 | "messages" (only the new ones), and every       "logprobs"?} ...
 SamplingParams field by its name (max_tokens:     {"type": "done", "finish_reason", "usage":
 max_new_tokens's OpenAI name), e.g.                {"prompt_tokens", "completion_tokens",
 temperature, top_p, seed, stop, logprobs}          "cached_tokens"}, "message"?}
{"type": "cancel"}                             ->  the live turn's "done", finish_reason "abort"
{"type": "close"}                              ->  {"type": "closed", "session_id"}
anything wrong                                 ->  {"type": "error", "message", "code", "param"}

A misspelt field is an error, as in the native route's sampling_params; SGLang's other
sampling fields are accepted because they cannot change the answer, or refused unless their
value asks for nothing (api/http/door_rules.py, TURN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from shoal.api.http.door_rules import TURN
from shoal.api.http.field_rules import refuse, with_rules
from shoal.api.http.openai_protocol import ChatMessage
from shoal.api.sampling_wire import wire_struct
from shoal.results import Completion, Delta, FinishReason, TokenLogprob

# ---- client -> server -------------------------------------------------------------------------


class _ClientMessage(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class Open(_ClientMessage, frozen=True, forbid_unknown_fields=True, tag="open"):
    timeout_s: float | None = None  # idle longer and the session is closed (default 600)
    max_tokens: int | None = None  # a cap on the whole history


# Every SamplingParams field, as declared (api/sampling_wire.py), then SGLang's other sampling
# fields (door_rules.TURN); mypy sees the base alone.
if TYPE_CHECKING:
    _TurnSampling = _ClientMessage
else:
    _TurnSampling = with_rules(
        "TurnRules",
        wire_struct("TurnSampling", "websocket", _ClientMessage, frozen=True),
        TURN,
        frozen=True,
    )


class Turn(_TurnSampling, frozen=True, forbid_unknown_fields=True, tag="turn"):
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None  # the OpenAI spelling of max_new_tokens

    def __post_init__(self) -> None:
        refuse(self, TURN)


class Cancel(_ClientMessage, frozen=True, forbid_unknown_fields=True, tag="cancel"):
    pass


class Close(_ClientMessage, frozen=True, forbid_unknown_fields=True, tag="close"):
    pass


ClientMessage = Open | Turn | Cancel | Close

# ---- server -> client -------------------------------------------------------------------------


class _ServerMessage(msgspec.Struct, frozen=True, tag_field="type"):
    pass


class Opened(_ServerMessage, frozen=True, tag="opened"):
    session_id: str


class TurnDelta(_ServerMessage, frozen=True, omit_defaults=True, tag="delta"):
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the turn asks


class TurnUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int  # the whole history plus this turn's input
    completion_tokens: int
    cached_tokens: int  # of the prompt, reused rather than prefilled


class Done(_ServerMessage, frozen=True, omit_defaults=True, tag="done"):
    finish_reason: FinishReason
    usage: TurnUsage
    message: str = ""  # why it was aborted or failed


class Closed(_ServerMessage, frozen=True, tag="closed"):
    session_id: str


class Error(_ServerMessage, frozen=True, tag="error"):
    message: str
    code: str | None = None  # as the HTTP error shape's: "session_busy", "invalid_value", ...
    param: str | None = None


ServerMessage = Opened | TurnDelta | Done | Closed | Error


class TurnFormat:
    """A turn's events as the server's messages (a StreamFormat, api/http/relay.py);
    `done_follows` is told just before its done goes out."""

    def __init__(self, done_follows: Callable[[], None]) -> None:
        self.done_follows = done_follows

    def first(self, index: int) -> ServerMessage | None:
        return None

    def delta(self, index: int, delta: Delta) -> ServerMessage | None:
        logprobs = None if delta.logprobs is None else list(delta.logprobs)
        return TurnDelta(delta.text, list(delta.token_ids), logprobs)

    def finish(self, index: int, completion: Completion) -> ServerMessage:
        self.done_follows()
        usage = completion.usage
        counts = TurnUsage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        return Done(completion.finish_reason, counts, completion.message)

    def last(self, completions: list[Completion]) -> ServerMessage | None:
        return None
