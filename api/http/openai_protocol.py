"""The OpenAI wire format: request bodies decoded by msgspec, response bodies encoded by it.

Fields the official client may send as null are Optional here. Every field of OpenAI's,
SGLang's and vLLM's request types is honoured, accepted because it cannot change the answer,
or refused with a 400 naming it (api/http/door_rules.py: CHAT, COMPLETIONS, STREAM_OPTIONS,
declared here by `with_rules` and checked by openai_params.refuse_unsupported); any other
field is a 400 too (forbid_unknown_fields), as OpenAI answers it: a misspelt `temprature`
is never silently ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec

from shoal.api.http.bootstrap_fields import RoomFields
from shoal.api.http.door_rules import CHAT, COMPLETIONS
from shoal.api.http.field_rules import with_rules
from shoal.api.http.native_protocol import SessionParams
from shoal.api.sampling_wire import wire_struct
from shoal.results import FinishReason

# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's and SGLang's: refused when true
    include_obfuscation: bool | None = None  # OpenAI's transport padding: accepted


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends and answers it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, rendered by the template
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any | None = None  # OpenAI's legacy functions: refused unless null
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that show it


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """response_format.json_schema: the schema the output must match (api/http/
    response_format.py). `name` and `description` label it; the output matches it exactly
    whatever `strict` says."""

    name: str | None = None
    schema_: Any = msgspec.field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's structured_outputs: one constraint (api/http/vllm_guided.py)."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None
    format: Any = None  # type structural_tag (SGLang's): the tag's format


class OpenAIFields(RoomFields, kw_only=True):
    """What /v1/chat/completions and /v1/completions share beside the sampling fields."""

    model: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # json_object, json_schema or text
    # vLLM's constraints (api/http/vllm_guided.py)
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    no_stop_trim: bool | None = None  # SGLang's name for include_stop_str_in_output
    session_params: SessionParams | None = None  # chat: the messages are the turn's new ones
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs, with this many top


class _ChatFields(OpenAIFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer max_tokens; it wins
    # the functions the model may call, and how (api/http/chat_tools.py)
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables


class _CompletionFields(OpenAIFields, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# Every SamplingParams field, in OpenAI's spelling (vLLM's and SGLang's for the extras: see
# api/sampling_wire.py), then every other field the door knows (api/http/door_rules.py).
# mypy sees the bases alone; the handlers read the sampling fields by wire_values.
if TYPE_CHECKING:
    _Chat = _ChatFields
    _Completion = _CompletionFields
else:
    _Chat = with_rules("ChatRules", wire_struct("ChatSampling", "chat", _ChatFields), CHAT)
    _Completion = with_rules(
        "CompletionRules",
        wire_struct("CompletionSampling", "completions", _CompletionFields),
        COMPLETIONS,
    )


class ChatCompletionRequest(_Chat, kw_only=True, forbid_unknown_fields=True):
    """The body of /v1/chat/completions."""


class CompletionRequest(_Completion, kw_only=True, forbid_unknown_fields=True):
    """The body of /v1/completions."""


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
    """OpenAI's legacy shape; with echo the prompt's tokens come first, the first one's
    logprob and top dict null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's prompt_logprobs entry: one token's logprob, its rank (1: the most likely) and
    its text."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: null for the first position, then per position the prompt token's
# and the top alternatives' entries, keyed by token id
PromptLogprobsOut = list[dict[str, PromptLogprob] | None]


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None  # --reasoning-parser: the <think> block's text
    tool_calls: list[ToolCall] | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


ChatFinishReason = FinishReason | Literal["tool_calls"]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's: the one prompt's, with it


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


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
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's, when asked


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
    family: str  # shoal's model family (models/registry.py)
    sliding_window: int | None  # the largest attention window of any layer; None: full
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
