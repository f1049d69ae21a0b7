"""Each door's rules for the fields it knows but does not honour (api/http/field_rules.py):
`Refused` unless the value asks for nothing, or `Accepted` because it cannot change the
answer. A field a door honours has no rule: its wire struct maps it (/generate's
return_routed_experts and routed_experts_start_len, which the OpenAI doors do not honour).

    CHAT, COMPLETIONS, STREAM_OPTIONS   the OpenAI routes (openai_params.refuse_unsupported)
    GENERATE, SAMPLING, SESSION         /generate, its sampling_params, session_params
    TURN                                the websocket's turn message
"""

from __future__ import annotations

from shoal.api.http.field_rules import (
    ADAPTER,
    CACHE_SALT,
    INPUTS,
    LOGITS,
    NOT_OUTPUT,
    PRIORITY,
    PROMPT,
    REPETITION,
    STRUCTURED,
    THINKING,
    TOOLS,
    Accepted,
    Refused,
    Rules,
)


def _accepted(why: str, *fields: str) -> dict[str, Accepted]:
    return dict.fromkeys(fields, Accepted(why))


def _refused(rule: Refused, *fields: str) -> dict[str, Refused]:
    return dict.fromkeys(fields, rule)


ROUTING = _accepted(
    "a router's or a cache's hint; one server, one model, no prefix routing",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "extra_key",
    "ngram_corpus_id",
    "session_id",
)
LABELS = _accepted(
    "bookkeeping; it changes neither the tokens nor the answer",
    "custom_labels",
    "user",
    "request_id",
)
MULTIMODAL_KNOBS = _accepted(
    "only images, video or audio read it, and those are refused",
    "images_config",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "use_audio_in_video",
)

# ---- the OpenAI doors -----------------------------------------------------------------------

_OPENAI: dict[str, Refused | Accepted] = {
    "guided_decoding_backend": Accepted("xgrammar is shoal's one grammar backend"),
    "guided_whitespace_pattern": STRUCTURED,
    "logits_processors": Refused(LOGITS, ([],)),
    "custom_logit_processor": Refused(LOGITS),
    "custom_params": Refused(LOGITS, ({},)),
    "bad_words": Refused(LOGITS, ([],)),
    "allowed_token_ids": Refused(LOGITS),
    "use_beam_search": Refused(": shoal samples; it does not search beams", (False,)),
    "truncate_prompt_tokens": Refused(": a prompt that does not fit is refused, never cut"),
    **_refused(
        NOT_OUTPUT,
        "return_hidden_states",
        "return_routed_experts",
        "return_cached_tokens_details",
        "return_token_ids",
        "return_tokens_as_token_ids",
    ),
    "lora_path": ADAPTER,
    "cache_salt": CACHE_SALT,
    "priority": PRIORITY,
    "kv_transfer_params": Refused(
        ": shoal disaggregates with SGLang's bootstrap fields, not vLLM's KV transfer", ({},)
    ),
    **_refused(
        REPETITION,
        "max_repetition_pattern_size",
        "min_repetition_pattern_size",
        "repetition_min_count",
    ),
    **ROUTING,
    **LABELS,
    **MULTIMODAL_KNOBS,
    "mm_processor_kwargs": MULTIMODAL_KNOBS["images_config"],
    "rid": Accepted("the route names the request itself (its id is the answer's id)"),
    "routed_experts_start_len": Accepted("only return_routed_experts reads it"),
    "spaces_between_special_tokens": Accepted("fast tokenizers ignore it, as shoal's do"),
    "length_penalty": Accepted("only beam search reads it"),
    "vllm_xargs": Accepted("only vLLM's plugins read it"),
}

CHAT: Rules = {
    **_OPENAI,
    "functions": Refused(TOOLS, ([],)),
    "function_call": Refused(TOOLS, ("none", "auto")),
    **_refused(Refused(PROMPT), "chat_template", "reasoning_effort", "reasoning", "task"),
    "input_ids": Refused(PROMPT),
    "documents": Refused(PROMPT, ([],)),
    "continue_final_message": Refused(PROMPT, (False,)),
    "add_generation_prompt": Refused(PROMPT, (True,)),
    "add_special_tokens": Refused(PROMPT, (False,)),
    "echo": Refused(PROMPT, (False,)),
    "best_of": Refused(": each choice is one sample, none is picked among several", (1,)),
    "audio": Refused(": shoal generates text only"),
    "modalities": Refused(": shoal generates text only", (["text"],)),
    "web_search_options": Refused(": shoal does not search the web"),
    "moderation": Refused(": shoal does not moderate the input or the answer"),
    "verbosity": Refused(": the model is not steered by it", ("medium",)),
    **_refused(NOT_OUTPUT, "return_prompt_token_ids", "return_meta_info"),
    **_accepted(
        "reasoning is separated by the server's --reasoning-parser, and always reported",
        "separate_reasoning",
        "stream_reasoning",
        "include_reasoning",
    ),
    **_accepted(
        "OpenAI's platform bookkeeping or caching; it changes neither the tokens nor the answer",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "prediction",  # a latency hint: the answer is the same with or without it
    ),
}

COMPLETIONS: Rules = {
    **_OPENAI,
    "suffix": Refused(": shoal completes after the prompt only", ("",)),
    "prompt_embeds": Refused(INPUTS),
    "add_special_tokens": Refused(": a text prompt is encoded with its special tokens", (True,)),
}

STREAM_OPTIONS: Rules = {
    "continuous_usage_stats": Refused(
        ": usage comes once, after the last choice (include_usage)", (False,)
    ),
    "include_obfuscation": Accepted("padding for OpenAI's encrypted transport"),
}

# ---- /generate, its sampling_params, session_params, the websocket's turn -------------------

SAMPLING: Rules = {  # SGLang's sampling_params beyond SamplingParams' fields
    "custom_params": Refused(LOGITS, ({},)),
    "spaces_between_special_tokens": Accepted("fast tokenizers ignore it, as shoal's do"),
    "stream_interval": Accepted("it batches streamed chunks; each is sent when it is ready"),
}

TURN: Rules = {
    **SAMPLING,
    "n": Refused(": a session turn has one choice", (1,)),
    "sampling_seed": Refused(": the websocket names it seed"),
    "no_stop_trim": Refused(": the websocket names it include_stop_str_in_output", (False,)),
}

GENERATE: Rules = {
    # SGLang's router sends "model": null (its own request type has the field)
    "model": Refused(": /generate answers with the one model served (GET /v1/models)"),
    **_refused(
        Refused(INPUTS, ([],)),
        "image_data",
        "video_data",
        "audio_data",
    ),
    **_refused(Refused(INPUTS), "input_embeds", "positional_embed_overrides", "mm_data_mooncake"),
    **_refused(
        NOT_OUTPUT,
        "return_sampling_mask",
        "return_text_in_logprobs",
        "return_flat_raw_top_logprobs",
        "return_flat_raw_top_logprobs_b64",
        "return_hidden_states",
        "return_indexer_topk",
        "return_bytes",
        "return_entropy",
        "return_prompt_token_ids",
    ),
    **_refused(ADAPTER, "lora_path", "lora_id"),
    "custom_logit_processor": Refused(LOGITS),
    "require_reasoning": Refused(THINKING, (False,)),
    "max_thinking_tokens": Refused(THINKING),
    "background": Refused(": every request is answered on its own connection", (False,)),
    "multi_item_delimiter_indices": Refused(": shoal does not score items"),
    "cache_salt": CACHE_SALT,
    "priority": PRIORITY,
    **ROUTING,
    **MULTIMODAL_KNOBS,
    **_accepted(
        "only images, video or audio read it, and those are refused",
        "mm_hashes",
        "mm_content_hashes",
        "modalities",
        "image_max_dynamic_patch",
        "video_max_dynamic_patch",
        "need_wait_for_mm_inputs",
        "num_items_assigned",
        "encoder_urls",
    ),
    **_accepted(
        "bookkeeping or tracing; it changes neither the tokens nor the answer",
        "custom_labels",
        "log_metrics",
        "no_logs",
        "routing_key",
        "conversation_id",
        "http_worker_ipc",
        "external_trace_header",
        "received_time",
    ),
    **_accepted(
        "SGLang's own disaggregation bookkeeping; shoal pairs by bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
    ),
}

SESSION: Rules = {  # SGLang's session_params beyond the id
    **_refused(
        Refused(": a session only appends; it does not branch, rewind or drop turns"),
        "rid",
        "offset",
    ),
    **_refused(
        Refused(": a session only appends; it does not branch, rewind or drop turns", (False,)),
        "replace",
        "drop_previous_output",
    ),
}
