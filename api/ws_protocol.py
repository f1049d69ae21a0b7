"""The session websocket's wire format (GET /v1/sessions/ws): one JSON object per text frame,
tagged by "type", decoded and encoded by msgspec.

client                                             server
{"type": "open", "timeout_s"?, "max_tokens"?}  ->  {"type": "opened", "session_id"}
{"type": "turn", one of "text" | "input_ids"   ->  {"type": "delta", "text", "token_ids"} ...
 | "messages" (only the new ones), sampling        {"type": "done", "finish_reason", "usage":
 fields: max_tokens / max_new_tokens,               {"prompt_tokens", "completion_tokens",
 temperature, top_p, top_k, seed, stop, ...}         "cached_tokens"}, "message"?}
{"type": "cancel"}                             ->  the live turn's "done", finish_reason "abort"
{"type": "close"}                              ->  {"type": "closed", "session_id"}
anything wrong                                 ->  {"type": "error", "message", "code", "param"}

A misspelt field is an error, as in the native route's sampling_params.
"""

from __future__ import annotations

import msgspec

from shoal.api.openai_protocol import ChatMessage
from shoal.results import FinishReason

# ---- client -> server -------------------------------------------------------------------------


class _ClientMessage(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class Open(_ClientMessage, frozen=True, forbid_unknown_fields=True, tag="open"):
    timeout_s: float | None = None  # idle longer and the session is closed (default 600)
    max_tokens: int | None = None  # a cap on the whole history


class Turn(_ClientMessage, frozen=True, forbid_unknown_fields=True, tag="turn"):
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None  # the OpenAI spelling of max_new_tokens
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None


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


class TurnDelta(_ServerMessage, frozen=True, tag="delta"):
    text: str
    token_ids: list[int]


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
