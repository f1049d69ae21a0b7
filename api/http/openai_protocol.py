"""The OpenAI wire format: request bodies decoded by msgspec, response bodies encoded by it.

Fields the official client may send as null are Optional here, and unknown fields are
ignored (clients add new ones faster than servers learn them). Fields we cannot honour
(tools, logit_bias, echo, suffix, a JSON response_format) are refused with 400 by the routes
rather than silently ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from shoal.api.http.bootstrap_fields import RoomFields
from shoal.api.http.native_protocol import SessionParams
from shoal.api.sampling_wire import wire_struct
from shoal.results import FinishReason

# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class OpenAIFields(RoomFields, kw_only=True):
    """What /v1/chat/completions and /v1/completions share beside the sampling fields."""

    model: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    session_params: SessionParams | None = None  # chat: the messages are the turn's new ones


# Every SamplingParams field, in OpenAI's spelling (vLLM's and SGLang's for the extras): see
# api/sampling_wire.py. mypy sees the base alone; the handlers read the fields by wire_values.
if TYPE_CHECKING:
    _ChatSampling = OpenAIFields
    _CompletionSampling = OpenAIFields
else:
    _ChatSampling = wire_struct("ChatSampling", "chat", OpenAIFields)
    _CompletionSampling = wire_struct("CompletionSampling", "completions", OpenAIFields)


class ChatCompletionRequest(_ChatSampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer max_tokens; it wins
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_CompletionSampling, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprobOut]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class AssistantMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class TextCompletion(msgspec.Struct):
    """Both the whole response and each streamed chunk of /v1/completions."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    family: str  # shoal's model family (kernels/models/registry.py)
    sliding_window: int | None  # the largest attention window of any layer; None: full
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
