"""No silent ignores (issue 29, item 8): every field of SGLang's, vLLM's and OpenAI's request
types is, at every door, honoured, accepted because it cannot change the answer, or refused
with a 400 naming it; and a field sent with a value that asks for nothing (null, "tools": [],
"tool_choice": "none", "logprobs": false) is accepted.

UPSTREAM copies the upstream request types' field names as data, with the doors that take
each type; OpenAI's as the openai package 3.57.0 declares them. Every field a door takes
(upstream, or given a rule by api/http/door_rules.py) must be classified in KINDS (BY_DOOR where
a door differs): a field added upstream fails test_every_field_is_classified until it is.

    door             what carries the field
    chat             the body of POST /v1/chat/completions
    completions      the body of POST /v1/completions
    generate         the body of POST /generate
    sampling_params  /generate's sampling_params
    session_params   session_params (on /generate; /v1/chat/completions decodes the same struct)
    stream_options   stream_options (on /v1/chat/completions; completions share the struct)
    turn             the session websocket's turn message
    open_session     the body of POST /open_session
    close_session    the body of POST /close_session

Honoured fields are sent with a value other than their default and must be answered (200);
test_sampling_doors.py shows each sampling field reaches the engine as asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from served import MODEL, Served, ServeFactory

from shoal.api.http import door_rules, field_rules
from shoal.api.http.openapi import document
from shoal.api.http.route_table import ROUTES

PROMPT = [5, 6, 7]
SESSION = "<an open session's id>"  # replaced by one, opened for the request
STRUCTURAL_TAG = '{"type": "structural_tag", "format": {"type": "const_string", "value": "a"}}'

# ---- the upstream request types --------------------------------------------------------------
# SGLang, python/sglang/srt/entrypoints/openai/protocol.py (ChatCompletionRequest,
# CompletionRequest) and python/sglang/srt/managers/io_struct.py (GenerateReqInput,
# SessionParams, OpenSessionReqInput, CloseSessionReqInput; BaseReq adds rid and
# http_worker_ipc) at commit 004c82e07d876f6e4a0ad6e15325706b0f478f1a;
# python/sglang/srt/sampling/sampling_params.py (SamplingParams, its API fields: not
# stop_strs, stop_regex_strs, stop_str_max_len, stop_regex_max_len, is_normalized) at commit
# 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03.
# vLLM, vllm/entrypoints/openai/protocol.py (ChatCompletionRequest, CompletionRequest of the
# guided_* releases) at commit 0052bed36509c7a5a2d8e48265334e40cf2f5a0e;
# vllm/entrypoints/openai/chat_completion/protocol.py and completion/protocol.py (the
# structured_outputs releases) at commit d5dba2d7b0ab9b98096560c69db7126b54b14d79;
# vllm/sampling_params.py (SamplingParams, its input fields: not output_kind, skip_clone,
# output_text_buffer_length or the _private ones) at commit
# 00388f6573ccfcffad607b8c9ecdf341a4669ceb.

SGLANG_SAMPLING = (
    *("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p"),
    *("top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"),
    *("min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos"),
    *("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params"),
    *("stream_interval", "logit_bias", "sampling_seed"),
)
VLLM_SAMPLING = (
    *("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature"),
    *("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens"),
    *("min_tokens", "logprobs", "prompt_logprobs", "prompt_logprob_token_ids"),
    *("prompt_logprob_start", "logprob_token_ids", "flat_logprobs", "detokenize"),
    *("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"),
    *("stream_interval", "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args"),
    *("bad_words", "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection"),
    *("routed_experts_prompt_start", "trace_decode_token_ids"),
)
SGLANG_SHARED = (  # fields both of SGLang's OpenAI requests declare
    *("model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n"),
    *("presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p"),
    *("user", "return_hidden_states", "return_routed_experts", "routed_experts_start_len"),
    *("return_cached_tokens_details", "return_token_ids", "top_k", "min_p", "min_tokens"),
    *("regex", "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex", "no_stop_trim"),
    *("ignore_eos", "skip_special_tokens", "lora_path", "session_id", "session_params"),
    *("response_format", "custom_params", "custom_logit_processor", "images_config"),
    *("bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank"),
    *("disagg_prefill_dp_rank", "data_parallel_rank", "rid", "extra_key", "cache_salt"),
    *("ngram_corpus_id", "priority"),
)
VLLM_SHARED = (  # fields both of vLLM's OpenAI requests declare, in either release
    *("model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n"),
    *("presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p"),
    *("user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty"),
    *("stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens"),
    *("skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens"),
    *("prompt_logprobs", "allowed_token_ids", "echo", "add_special_tokens", "response_format"),
    *("guided_json", "guided_regex", "guided_choice", "guided_grammar"),
    *("guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs"),
    *("priority", "request_id", "logits_processors", "return_tokens_as_token_ids"),
    *("return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs"),
    *("max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count"),
)
UPSTREAM: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # type: (doors, fields)
    "sglang ChatCompletionRequest": (
        ("chat",),
        (
            *SGLANG_SHARED,
            *("messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice"),
            *("parallel_tool_calls", "return_prompt_token_ids", "return_meta_info"),
            *("reasoning_effort", "task", "continue_final_message", "separate_reasoning"),
            *("stream_reasoning", "chat_template_kwargs", "max_dynamic_patch"),
            *("min_dynamic_patch", "use_audio_in_video", "input_ids"),
            "reasoning",  # not a field: normalize_reasoning_inputs reads it from the body
        ),
    ),
    "sglang CompletionRequest": (
        ("completions",),
        (*SGLANG_SHARED, "prompt", "best_of", "echo", "suffix", "json_schema", "custom_labels"),
    ),
    "sglang GenerateReqInput": (
        ("generate",),
        (
            *("rid", "http_worker_ipc", "session_id", "text", "input_ids", "input_embeds"),
            *("image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes"),
            *("use_audio_in_video", "sampling_params", "return_logprob", "logprob_start_len"),
            *("top_logprobs_num", "token_ids_logprob", "return_sampling_mask"),
            *("return_text_in_logprobs", "return_flat_raw_top_logprobs"),
            *("return_flat_raw_top_logprobs_b64", "stream", "log_metrics"),
            *("return_hidden_states", "return_routed_experts", "routed_experts_start_len"),
            *("return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id"),
            *("custom_logit_processor", "positional_embed_overrides", "bootstrap_host"),
            *("bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size"),
            *("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key"),
            *("conversation_id", "background", "require_reasoning", "max_thinking_tokens"),
            *("priority", "extra_key", "ngram_corpus_id", "no_logs", "custom_labels"),
            *("return_bytes", "return_entropy", "return_prompt_token_ids"),
            *("external_trace_header", "received_time", "need_wait_for_mm_inputs"),
            *("num_items_assigned", "mm_data_mooncake", "encoder_urls", "max_dynamic_patch"),
            *("min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch"),
            *("images_config", "multi_item_delimiter_indices", "cache_salt"),
        ),
    ),
    "sglang SamplingParams": (("sampling_params", "turn"), SGLANG_SAMPLING),
    "sglang SessionParams": (
        ("session_params",),
        ("id", "rid", "offset", "replace", "drop_previous_output"),
    ),
    "sglang OpenSessionReqInput": (
        ("open_session",),
        ("capacity_of_str_len", "session_id", "streaming", "timeout", "rid", "http_worker_ipc"),
    ),
    "sglang CloseSessionReqInput": (("close_session",), ("session_id", "rid", "http_worker_ipc")),
    "sglang and vllm StreamOptions": (
        ("stream_options",),
        ("include_usage", "continuous_usage_stats"),
    ),
    "vllm ChatCompletionRequest": (
        ("chat",),
        (
            *VLLM_SHARED,
            *("messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice"),
            *("reasoning_effort", "include_reasoning", "parallel_tool_calls", "best_of"),
            *("bad_words", "add_generation_prompt", "continue_final_message", "documents"),
            *("chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag"),
        ),
    ),
    "vllm CompletionRequest": (
        ("completions",),
        (*VLLM_SHARED, "prompt", "prompt_embeds", "best_of", "suffix"),
    ),
    "vllm SamplingParams": (("sampling_params", "turn"), VLLM_SAMPLING),
}


# OpenAI's request types as the openai package 3.57.0 declares them
# (openai/types/chat/completion_create_params.py CompletionCreateParamsBase,
# openai/types/completion_create_params.py CompletionCreateParamsBase,
# openai/types/chat/chat_completion_stream_options_param.py). Written down rather than read
# from the installed package, so that a new openai release cannot turn a fresh clone's CI red;
# what a newer package adds is refused until classified
# (`test_fields_a_newer_openai_package_adds_are_refused`).
OPENAI_FIELDS: dict[str, frozenset[str]] = {
    "chat": frozenset(
        (
            *("audio", "frequency_penalty", "function_call", "functions", "logit_bias"),
            *("logprobs", "max_completion_tokens", "max_tokens", "messages", "metadata"),
            *("modalities", "model", "moderation", "n", "parallel_tool_calls", "prediction"),
            *("presence_penalty", "prompt_cache_key", "prompt_cache_options"),
            *("prompt_cache_retention", "reasoning_effort", "response_format"),
            *("safety_identifier", "seed", "service_tier", "stop", "store", "stream"),
            *("stream_options", "temperature", "tool_choice", "tools", "top_logprobs"),
            *("top_p", "user", "verbosity", "web_search_options"),
        )
    ),
    "completions": frozenset(
        (
            *("best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens"),
            *("model", "n", "presence_penalty", "prompt", "seed", "stop", "stream"),
            *("stream_options", "suffix", "temperature", "top_p", "user"),
        )
    ),
    "stream_options": frozenset(("include_obfuscation", "include_usage")),
}


def openai_fields() -> dict[str, frozenset[str]]:
    return OPENAI_FIELDS


def installed_openai_fields() -> dict[str, set[str]]:
    """The installed openai package's request fields, per door."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import ChatCompletionStreamOptionsParam
    from openai.types.chat import completion_create_params as chat

    def keys(kind: Any) -> set[str]:
        return set(kind.__required_keys__ | kind.__optional_keys__)

    return {
        "chat": keys(chat.CompletionCreateParamsStreaming),
        "completions": keys(completions.CompletionCreateParamsStreaming),
        "stream_options": keys(ChatCompletionStreamOptionsParam),
    }


# ---- the classification ----------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    kind: str  # "honoured" | "accepted" (taken, changes nothing) | "refused"
    value: Any  # a value other than the default: answered, or refused
    neutral: tuple[Any, ...] = ()  # refused: values that ask for nothing, so are answered
    extra: Mapping[str, Any] = field(default_factory=dict)  # sent with it (a field it needs)
    drop: str | None = None  # a field of the base request it replaces


def H(value: Any, drop: str | None = None, **extra: Any) -> Kind:
    return Kind("honoured", value, extra=extra, drop=drop)


def N(value: Any) -> Kind:
    return Kind("accepted", value)


def R(value: Any, *neutral: Any, **extra: Any) -> Kind:
    return Kind("refused", value, neutral, extra)


KINDS: dict[str, Kind] = {
    # honoured everywhere they are known
    **{"model": H(MODEL), "messages": H([{"role": "user", "content": "hi"}])},
    **{"frequency_penalty": H(0.5), "presence_penalty": H(0.5), "repetition_penalty": H(1.1)},
    **{"temperature": H(0.5), "top_p": H(0.9), "top_k": H(5), "min_p": H(0.1), "seed": H(7)},
    **{"stop": H(["zz"]), "stop_token_ids": H([3]), "ignore_eos": H(True), "n": H(2)},
    **{"skip_special_tokens": H(False), "max_tokens": H(2), "min_tokens": H(1)},
    **{"max_completion_tokens": H(2), "logprobs": H(True), "stream": H(True)},
    **{"top_logprobs": H(2, logprobs=True), "stream_options": H({"include_usage": True})},
    **{"session_params": H(SESSION), "max_new_tokens": H(2), "min_new_tokens": H(1)},
    **{"bootstrap_host": H("127.0.0.1"), "bootstrap_port": H(8998)},
    "bootstrap_room": H(7, bootstrap_host="127.0.0.1"),
    # structured output (SGLang's names and OpenAI's response_format): honoured
    **{"regex": H("a+"), "ebnf": H('root ::= "a"'), "json_schema": H('{"type": "object"}')},
    "structural_tag": H(STRUCTURAL_TAG),
    "response_format": H({"type": "json_object"}),
    # vLLM's constraints: honoured (but a whitespace pattern); tools, logits
    **{"guided_regex": H("a+"), "guided_grammar": H('root ::= "a"')},
    **{"guided_json": H({"type": "object"}), "guided_choice": H(["a", "b"])},
    **{"guided_decoding_backend": N("xgrammar"), "guided_whitespace_pattern": R(" ", None)},
    **{"structured_outputs": H({"regex": "a+"}), "stop_regex": H(["zz+"])},
    "tools": H([{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
    "tool_choice": H("required", tools=[{"type": "function", "function": {"name": "f"}}]),
    "functions": R([{"name": "f"}], None, []),
    "function_call": R({"name": "f"}, None, "none", "auto"),
    **{"logit_bias": H({"5": 1.0}), "logits_processors": R(["m.P"], None, [])},
    **{"custom_logit_processor": R("p", None), "custom_params": R({"a": 1}, None, {})},
    **{"bad_words": R(["x"], None, []), "allowed_token_ids": R([5], None)},
    # the prompt: shoal renders it from the messages alone
    **{"chat_template": R("{{ messages }}", None), "reasoning_effort": R("low", None)},
    **{"reasoning": R({"effort": "low"}, None), "task": R("domain", None)},
    **{"chat_template_kwargs": H({"enable_thinking": False})},
    **{"documents": R([{"title": "a", "text": "b"}], None, [])},
    **{
        "continue_final_message": R(True, None, False),
        "add_generation_prompt": R(False, None, True),
    },
    **{"add_special_tokens": R(True, None, False), "echo": R(True, None, False)},
    **{"input_ids": R([5, 6], None), "truncate_prompt_tokens": R(5, None)},
    # the answer: what it carries
    **{name: H(True) for name in ("no_stop_trim", "include_stop_str_in_output")},
    **{"prompt_logprobs": H(1), "use_beam_search": R(True, None, False)},
    **{"best_of": R(2, None, 1), "suffix": R("x", None, ""), "prompt_embeds": R("AAAA", None)},
    **{
        name: R(True, None, False)
        for name in (
            *("return_hidden_states", "return_routed_experts", "return_cached_tokens_details"),
            *("return_token_ids", "return_tokens_as_token_ids", "return_prompt_token_ids"),
            *("return_meta_info", "return_sampling_mask", "return_text_in_logprobs"),
            *("return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64"),
            *("return_indexer_topk", "return_bytes", "return_entropy"),
        )
    },
    **{"audio": R({"voice": "alloy", "format": "wav"}, None)},
    **{"modalities": R(["text", "audio"], None, ["text"]), "verbosity": R("low", None, "medium")},
    **{"web_search_options": R({}, None), "moderation": R({"model": "omni-moderation"}, None)},
    # the server: adapters, cache isolation, scheduling, vLLM's disaggregation, early stops
    **{"lora_path": R("adapter", None), "lora_id": R("adapter", None)},
    **{"cache_salt": R("salt", None, ""), "priority": R(1, None, 0)},
    "kv_transfer_params": R({"do_remote_prefill": True}, None, {}),
    **{name: R(3, None, 0) for name in ("max_repetition_pattern_size", "repetition_min_count")},
    "min_repetition_pattern_size": R(1, None, 0),
    # accepted: they change neither the tokens nor the answer
    **{"user": N("u"), "metadata": N({"k": "v"}), "store": N(True), "service_tier": N("flex")},
    **{"safety_identifier": N("s"), "prompt_cache_key": N("k"), "prompt_cache_retention": N("24h")},
    **{
        "prompt_cache_options": N({"ttl": "1h"}),
        "prediction": N({"type": "content", "content": "x"}),
    },
    "parallel_tool_calls": H(
        False, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"
    ),
    "separate_reasoning": N(False),
    **{"stream_reasoning": N(False), "include_reasoning": N(False)},
    **{"max_dynamic_patch": N(4), "min_dynamic_patch": N(1), "use_audio_in_video": N(True)},
    **{"images_config": N({"a": 1}), "mm_processor_kwargs": N({"a": 1})},
    **{"rid": N("r"), "request_id": N("r"), "session_id": N("s"), "extra_key": N("k")},
    **{"ngram_corpus_id": N("c"), "routed_dp_rank": N(0), "data_parallel_rank": N(0)},
    **{"disagg_prefill_dp_rank": N(0), "custom_labels": N({"a": "b"})},
    **{"routed_experts_start_len": N(3), "spaces_between_special_tokens": N(False)},
    **{"length_penalty": N(2.0), "vllm_xargs": N({"a": 1}), "stream_interval": N(2)},
}

# vLLM's SamplingParams names SGLang's sampling_params (and the turn) do not take: refused as
# unknown fields, null included
VLLM_ONLY_SAMPLING: dict[str, Kind] = {
    **{"prompt_logprobs": R(1), "prompt_logprob_token_ids": R([5]), "prompt_logprob_start": R(0)},
    **{"logprob_token_ids": R([5]), "flat_logprobs": R(True), "detokenize": R(False)},
    **{"include_stop_str_in_output": R(True), "structured_outputs": R({"regex": "a+"})},
    **{"allowed_token_ids": R([5]), "extra_args": R({"a": 1}), "bad_words": R(["x"])},
    **{"skip_reading_prefix_cache": R(True), "thinking_token_budget": R(10)},
    **{"repetition_detection": R({"max_pattern_size": 2, "min_count": 2})},
    **{"routed_experts_prompt_start": R(1), "trace_decode_token_ids": R([5])},
    **{"max_tokens": R(2), "min_tokens": R(1), "logprobs": R(2)},
}
SGLANG_SAMPLING_EXTRAS: dict[str, Kind] = {}

BY_DOOR: dict[str, dict[str, Kind]] = {
    "completions": {
        "logprobs": H(2),
        "prompt": H(PROMPT),
        "echo": H(True),  # the prompt before the completion (chat's echo is vLLM's other one)
        "session_params": R({"id": "x"}, None),  # sessions are chat's and /generate's
        "best_of": R(3, None, 1),
        "add_special_tokens": R(False, None, True),  # a text prompt gets its special tokens
    },
    "generate": {
        "model": R(MODEL, None),  # SGLang's router sends null; a name is not checked here
        "text": H("hi", drop="input_ids"),
        "input_ids": H(PROMPT),
        "rid": H("fields-rid"),
        "sampling_params": H({"max_new_tokens": 1}),
        "return_logprob": H(True),
        "top_logprobs_num": H(2, return_logprob=True),
        "logprob_start_len": H(0, return_logprob=True),  # prompt logprobs
        "token_ids_logprob": H([5], return_logprob=True),
        # honoured on a mixture-of-experts model (tests/api/http/test_http_routed_experts.py);
        # this server's model is dense, so asking is refused (false asks for nothing)
        "return_routed_experts": R(True, None, False),
        "routed_experts_start_len": H(3),  # read only with return_routed_experts
        **{name: R("data", None, []) for name in ("image_data", "video_data", "audio_data")},
        **{"input_embeds": R([[0.0]], None), "positional_embed_overrides": R({"a": 1}, None)},
        "mm_data_mooncake": R([1], None),
        **{"require_reasoning": R(True, None, False), "max_thinking_tokens": R(5, None)},
        **{"background": R(True, None, False), "multi_item_delimiter_indices": R([1], None)},
        **{"modalities": N(["image"]), "mm_hashes": N(["h"]), "mm_content_hashes": N(["h"])},
        **{"image_max_dynamic_patch": N(2), "video_max_dynamic_patch": N(2)},
        **{"need_wait_for_mm_inputs": N(True), "num_items_assigned": N({"image": [1]})},
        **{"encoder_urls": N(["u"]), "log_metrics": N(False), "no_logs": N(True)},
        **{"routing_key": N("k"), "conversation_id": N("c"), "http_worker_ipc": N("ipc")},
        **{"external_trace_header": N({"a": "b"}), "received_time": N(1.0)},
        **{"bootstrap_pair_key": N("p"), "decode_tp_size": N(2)},
    },
    "sampling_params": {
        **VLLM_ONLY_SAMPLING,
        **SGLANG_SAMPLING_EXTRAS,
        "sampling_seed": H(7),
    },
    "turn": {
        **VLLM_ONLY_SAMPLING,
        **SGLANG_SAMPLING_EXTRAS,
        "n": R(2, None, 1),  # a session turn has one choice
        "sampling_seed": R(7, None),  # the websocket names it seed
        "include_stop_str_in_output": H(True),  # the websocket names it so, as Python does
        "no_stop_trim": R(True, None, False),
        "max_tokens": H(2, drop="max_new_tokens"),  # the websocket's OpenAI spelling
        "logprobs": H(True),
    },
    "session_params": {
        "id": H(SESSION),
        **{"rid": R("r", None), "offset": R(0, None)},
        **{"replace": R(True, None, False), "drop_previous_output": R(True, None, False)},
    },
    "stream_options": {
        "include_usage": H(True),
        "continuous_usage_stats": R(True, None, False),
        "include_obfuscation": N(True),
    },
    "open_session": {  # not fields of shoal's: refused as unknown
        **{"capacity_of_str_len": R(100), "session_id": R("s"), "streaming": R(True)},
        **{"timeout": R(5.0), "rid": R("r"), "http_worker_ipc": R("ipc")},
    },
    "close_session": {"session_id": H(SESSION), "rid": R("r"), "http_worker_ipc": R("ipc")},
}

RULES: Mapping[str, field_rules.Rules] = {
    "chat": door_rules.CHAT,
    "completions": door_rules.COMPLETIONS,
    "generate": door_rules.GENERATE,
    "sampling_params": door_rules.SAMPLING,
    "turn": door_rules.TURN,
    "session_params": door_rules.SESSION,
    "stream_options": door_rules.STREAM_OPTIONS,
}
DOORS = (
    *("chat", "completions", "generate", "sampling_params", "session_params"),
    *("stream_options", "turn", "open_session", "close_session"),
)
PREFIX = {"sampling_params": "sampling_params.", "session_params": "session_params."}
PREFIX["stream_options"] = "stream_options."


def door_fields(door: str) -> set[str]:
    """Every field the door must classify: upstream's, and those shoal declares a rule for."""
    names = set(RULES.get(door, {}))
    for doors, fields in UPSTREAM.values():
        if door in doors:
            names |= set(fields)
    return names | openai_fields().get(door, set())


def kind_of(door: str, name: str) -> Kind | None:
    return BY_DOOR.get(door, {}).get(name) or KINDS.get(name)


def test_every_field_is_classified() -> None:
    missing = {
        door: sorted(n for n in door_fields(door) if kind_of(door, n) is None) for door in DOORS
    }
    assert not any(missing.values()), f"classify these fields in KINDS or BY_DOOR: {missing}"


def test_the_rules_agree_with_the_classification() -> None:
    """What field_rules accepts is classified accepted, what it refuses refused."""
    for door, rules in RULES.items():
        for name, rule in rules.items():
            kind = kind_of(door, name)
            assert kind is not None, (door, name)
            if kind.kind != "honoured":  # a rule for a typed field the door maps (n, seed)
                want = "refused" if isinstance(rule, field_rules.Refused) else "accepted"
                assert kind.kind == want, (door, name, kind.kind)


# ---- sending a field through a door ----------------------------------------------------------


@dataclass
class Answer:
    status: int  # a websocket error message counts as 400, a done as 200
    error: dict[str, Any] | None  # the error's body: message, param, code


async def read_answer(resp: Any) -> Answer:
    if resp.status == 200:
        await resp.read()  # a stream, to its end
        return Answer(200, None)
    return Answer(resp.status, (await resp.json())["error"])


class Doors:
    """Sends fields through each door of a served app: one request per call."""

    def __init__(self, s: Served) -> None:
        self.s = s

    async def post(self, path: str, body: Any) -> Answer:
        async with self.s.http.post(self.s.url + path, json=body) as resp:
            return await read_answer(resp)

    async def open_session(self) -> str:
        async with self.s.http.post(self.s.url + "/open_session", json={}) as resp:
            assert resp.status == 200, await resp.text()
            session_id: str = (await resp.json())["session_id"]
            return session_id

    async def close_session(self, session_id: str) -> None:
        body = {"session_id": session_id}
        async with self.s.http.post(self.s.url + "/close_session", json=body) as resp:
            assert resp.status == 200, await resp.text()

    async def send(self, door: str, fields: dict[str, Any], drop: str | None = None) -> Answer:
        session_id = None
        if SESSION in fields.values() or door in ("session_params", "close_session"):
            session_id = await self.open_session()
        fields = {k: _session(k, v, session_id) for k, v in fields.items()}
        try:
            return await self._send(door, fields, drop, session_id)
        finally:
            if session_id is not None and door != "close_session":
                await self.close_session(session_id)

    async def _send(
        self, door: str, fields: dict[str, Any], drop: str | None, session_id: str | None
    ) -> Answer:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        generate: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        match door:
            case "chat":
                return await self.post("/v1/chat/completions", _merge(chat, fields, drop))
            case "completions":
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
                return await self.post("/v1/completions", _merge(body, fields, drop))
            case "generate":
                return await self.post("/generate", _merge(generate, fields, drop))
            case "sampling_params":
                sampling = _merge(generate["sampling_params"], fields, drop)
                return await self.post("/generate", {**generate, "sampling_params": sampling})
            case "session_params":
                params = _merge({"id": session_id}, fields, drop)
                return await self.post("/generate", {**generate, "session_params": params})
            case "stream_options":
                body = {**chat, "stream": True, "stream_options": fields}
                return await self.post("/v1/chat/completions", body)
            case "open_session":
                answer = await self.post("/open_session", fields)
                return answer  # refused: nothing was opened
            case "close_session":
                body = _merge({"session_id": session_id}, fields, drop)
                answer = await self.post("/close_session", body)
                if answer.status != 200:
                    assert session_id is not None
                    await self.close_session(session_id)
                return answer
            case "turn":
                return await self.turn(fields, drop)
        raise AssertionError(door)

    async def turn(self, fields: dict[str, Any], drop: str | None) -> Answer:
        """Open a session on a websocket, send one turn, close: the turn's done or error."""
        turn = _merge({"type": "turn", "input_ids": PROMPT, "max_new_tokens": 1}, fields, drop)
        async with self.s.http.ws_connect(self.s.url + "/v1/sessions/ws") as ws:
            await ws.send_json({"type": "open"})
            assert (await ws.receive_json(timeout=60))["type"] == "opened"
            await ws.send_json(turn)
            while (reply := await ws.receive_json(timeout=60))["type"] == "delta":
                pass
            await ws.send_json({"type": "close"})
            assert (await ws.receive_json(timeout=60))["type"] == "closed"
        if reply["type"] == "error":
            return Answer(400, reply)
        assert reply["type"] == "done", reply
        return Answer(200, None)


def _merge(base: dict[str, Any], fields: dict[str, Any], drop: str | None) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k != drop} | fields


def _session(name: str, value: Any, session_id: str | None) -> Any:
    """SESSION as the field takes it: session_params an object, the others the id."""
    if value != SESSION:
        return value
    return {"id": session_id} if name == "session_params" else session_id


def check(answer: Answer, kind: str, param: str, sent: Any) -> str | None:
    """Why the answer is not the one `kind` calls for (None: it is)."""
    if kind != "refused":
        return None if answer.status == 200 else f"{sent}: {answer.status} {answer.error}"
    error = answer.error or {}
    if answer.status != 400 or error.get("param") != param:
        return f"{sent}: want 400 naming {param!r}, got {answer.status} {error}"
    if param.split(".")[-1] not in error.get("message", ""):
        return f"{sent}: the message does not name {param!r}: {error}"
    return None


# ---- every door ------------------------------------------------------------------------------


@pytest.mark.parametrize("door", DOORS)
async def test_every_field_is_honoured_accepted_or_refused(serve: ServeFactory, door: str) -> None:
    s = await serve(max_n=2)
    doors = Doors(s)
    prefix = PREFIX.get(door, "")
    wrong: list[str] = []
    for name in sorted(door_fields(door)):
        kind = kind_of(door, name)
        assert kind is not None, name  # test_every_field_is_classified names them all
        sent = {name: kind.value, **kind.extra}
        why = check(await doors.send(door, sent, kind.drop), kind.kind, prefix + name, sent)
        wrong += [why] if why else []
        for quiet in kind.neutral:  # a value that asks for nothing is answered
            sent = {name: quiet, **kind.extra}
            why = check(await doors.send(door, sent), "accepted", prefix + name, sent)
            wrong += [why] if why else []
    misspelt = {"temprature": 0.5}  # a field no one declares: refused, never ignored
    why = check(await doors.send(door, misspelt), "refused", prefix + "temprature", misspelt)
    wrong += [why] if why else []
    assert not wrong, f"{door}:\n" + "\n".join(wrong)
    await s.engine.wait_idle(timeout_s=10)


# ---- what the issue found ignored ------------------------------------------------------------

ISSUE: list[tuple[str, dict[str, Any], str]] = [  # door, field, what the message must say
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "legacy functions"),
    ("chat", {"tool_choice": "required"}, "needs tools"),  # without tools
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
]


@pytest.mark.parametrize(("door", "fields", "says"), ISSUE)
async def test_what_the_issue_found_ignored_is_refused(
    serve: ServeFactory, door: str, fields: dict[str, Any], says: str
) -> None:
    s = await serve()
    answer = await Doors(s).send(door, fields)
    [name] = fields
    param = PREFIX.get(door, "") + name
    assert answer.status == 400 and answer.error is not None, (answer.status, answer.error)
    assert answer.error["param"] == param and says in answer.error["message"], answer.error


async def test_fields_a_newer_openai_package_adds_are_refused(serve: ServeFactory) -> None:
    """The installed openai package may declare fields OPENAI_FIELDS (3.57.0's) does not:
    until someone classifies them, each must be refused, never ignored. With the pinned
    package there are none, and the made-up one stands in for them."""
    s = await serve()
    doors = Doors(s)
    installed = installed_openai_fields()
    wrong = []
    for door, fields in OPENAI_FIELDS.items():
        added = sorted(installed[door] - fields - door_fields(door)) or ["a_field_openai_adds"]
        for name in added:
            sent = {name: {"a": 1}}
            param = f"stream_options.{name}" if door == "stream_options" else name
            why = check(await doors.send(door, sent), "refused", param, sent)
            wrong += [f"{door}: {why}"] if why else []
    assert not wrong, "\n".join(wrong)


async def test_values_that_ask_for_nothing_are_answered(serve: ServeFactory) -> None:
    s = await serve()
    doors = Doors(s)
    quiet = {"logprobs": False, "tools": [], "tool_choice": "none", "regex": None}
    quiet |= {"response_format": {"type": "text"}, "logit_bias": {}, "functions": None}
    assert (await doors.send("chat", quiet)).status == 200
    quiet = {"regex": None, "n": 1, "no_stop_trim": False, "stop_regex": []}
    assert (await doors.send("sampling_params", quiet)).status == 200
    assert (await doors.send("turn", quiet)).status == 200
    quiet = {"return_hidden_states": False, "lora_path": None, "image_data": []}
    assert (await doors.send("generate", quiet)).status == 200


async def test_a_turn_through_chat_refuses_as_chat_does(serve: ServeFactory) -> None:
    """A session turn on /v1/chat/completions decodes the same body: refused alike."""
    s = await serve()
    doors = Doors(s)
    answer = await doors.send("chat", {"session_params": SESSION, "guided_whitespace_pattern": " "})
    param = answer.error and answer.error["param"]
    assert answer.status == 400 and param == "guided_whitespace_pattern", answer
    bad = {"session_params": {"id": "x", "offset": 0}}  # 0 == False: still refused
    answer = await doors.send("chat", bad)
    assert answer.error and answer.error["param"] == "session_params.offset", answer


async def test_messages_carrying_tool_calls_are_taken_from_the_assistant_only(
    serve: ServeFactory,
) -> None:
    """An assistant's calls go to the template (tests/api/http/test_tools_http.py checks
    what it renders); calls on another role, and the legacy function_call, are refused."""
    s = await serve()
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "user", "content": "and?"},
    ]
    assert (await Doors(s).send("chat", {"messages": messages})).status == 200
    messages[0] = {"role": "user", "content": "hi", "tool_calls": calls}
    answer = await Doors(s).send("chat", {"messages": messages})
    assert answer.status == 400 and answer.error, answer
    assert answer.error["param"] == "messages[0].tool_calls", answer.error
    messages[0] = {"role": "user", "content": "hi", "function_call": {"name": "f"}}
    answer = await Doors(s).send("chat", {"messages": messages})
    assert answer.error and answer.error["param"] == "messages[0].function_call", answer


def test_the_document_says_what_a_refused_field_takes() -> None:
    schemas = document(ROUTES)["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False
    assert chat["properties"]["guided_whitespace_pattern"]["enum"] == [None]
    assert chat["properties"]["function_call"]["enum"] == [None, "none", "auto"]
    assert "--json-any-whitespace" in chat["properties"]["guided_whitespace_pattern"]["description"]
    assert "accepted and ignored" in chat["properties"]["metadata"]["description"]
    assert schemas["GenerateRequest"]["additionalProperties"] is False
    assert msgspec.json.encode(schemas)  # the document stays JSON
