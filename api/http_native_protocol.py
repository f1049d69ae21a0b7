"""The native wire format, named as SGLang names it so RL tooling can switch servers.

    POST /generate {"text": "..." | ["...", ...], "input_ids": [..] | [[..], ..],
                    "sampling_params": {...} | [{...}, ...], "rid": "..." | [...],
                    "stream": false, "return_logprob": false, "top_logprobs_num": 0,
                    "session_params": {"id": "<an id from POST /open_session>"}}
      -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
          "completion_tokens", "cached_tokens", "weight_version", "e2e_latency", ...}}
         (a list of those for a batch)

finish_reason is {"type": "stop", "matched": <stop string or token id>},
{"type": "length", "length": N} or {"type": "abort", "message": "..."}.
"""

from __future__ import annotations

from typing import Any

import msgspec


class NativeSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling_params; a misspelt field is a 400, not silently ignored."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None  # accepted; the detokenizer decides
    seed: int | None = None
    sampling_seed: int | None = None


class SessionParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Run the request as the next turn of an open session (POST /open_session): its prompt
    is only what is new. SGLang's branching fields are accepted only when null."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: NativeSampling | list[NativeSampling] | None = None
    rid: str | list[str] | None = None
    stream: bool | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None  # accepted; only output logprobs are reported
    session_params: SessionParams | None = None


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str | None = None
    abort_all: bool | None = None


class MetaInfo(msgspec.Struct, omit_defaults=True):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: int
    e2e_latency: float
    # [logprob, token_id, null] per output token; [[...] * top_logprobs_num] per token
    output_token_logprobs: list[tuple[float, int, None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, None]]] | None = None


class GenerateResponse(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
