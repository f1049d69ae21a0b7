"""The native wire format, named as SGLang names it so RL tooling can switch servers.

    POST /generate {"text": "..." | ["...", ...], "input_ids": [..] | [[..], ..],
                    "sampling_params": {...} | [{...}, ...], "rid": "..." | [...],
                    "stream": false, "return_logprob": false, "top_logprobs_num": 0,
                    "logprob_start_len": -1, "token_ids_logprob": [..],
                    "return_routed_experts": false, "routed_experts_start_len": 0,
                    "session_params": {"id": "<an id from POST /open_session>"}}
      -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
          "completion_tokens", "cached_tokens", "weight_version", "e2e_latency", ...}}
         (a list of those for a batch)

finish_reason is {"type": "stop", "matched": <stop string or token id>},
{"type": "length", "length": N} or {"type": "abort", "message": "..."}.

With return_logprob, meta_info also has output_token_logprobs ([logprob, token_id, null] per
output token), output_top_logprobs (with top_logprobs_num), the prompt's input_token_logprobs
and input_top_logprobs from logprob_start_len (-1, the default: [] as SGLang; position 0's
logprob and top list null: nothing precedes it), and with token_ids_logprob
input_token_ids_logprobs and output_token_ids_logprobs (each position: those ids' rows).
max_new_tokens 0 answers the prefill alone (scoring a sequence). With return_routed_experts (a
mixture-of-experts model), the finished answer's meta_info has routed_experts (MetaInfo).

Every other field of SGLang's GenerateReqInput, sampling_params and session_params is
accepted because it cannot change the answer, or refused with a 400 naming it unless its
value asks for nothing (api/http/door_rules.py: GENERATE, SAMPLING, SESSION), as the body is
decoded; a field SGLang does not know either is a 400 (forbid_unknown_fields).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from shoal.api.http.bootstrap_fields import RoomFields
from shoal.api.http.door_rules import GENERATE, SAMPLING, SESSION
from shoal.api.http.field_rules import refuse, with_rules
from shoal.api.sampling_wire import BESIDE_SAMPLING, IN_SAMPLING, wire_struct


class SessionParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Run the request as the next turn of an open session (POST /open_session): its prompt
    is only what is new. SGLang's branching fields are refused unless null (or false)."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None

    def __post_init__(self) -> None:
        refuse(self, SESSION, "session_params.")


class NativeExtras(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling_params beyond SamplingParams' fields; a misspelt field is a 400, not
    silently ignored."""

    spaces_between_special_tokens: bool | None = None  # accepted; the detokenizer decides
    sampling_seed: int | None = None  # seed's other name; seed wins
    n: int | None = None  # samples per prompt: the same in every sampling_params of a batch


class GenerateFields(RoomFields, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    rid: str | list[str] | None = None
    stream: bool | None = None
    session_params: SessionParams | None = None


# The SamplingParams fields (api/sampling_wire.py): the logprob and routed experts fields
# beside sampling_params (return_logprob, top_logprobs_num, logprob_start_len,
# token_ids_logprob, return_routed_experts, routed_experts_start_len), every other one in it;
# then SGLang's other fields
# (door_rules). mypy sees the bases alone.
if TYPE_CHECKING:
    _NativeSampling = NativeExtras
    _Generate = GenerateFields
else:
    _NativeSampling = with_rules(
        "NativeSamplingRules",
        wire_struct("NativeSamplingFields", "native", NativeExtras, IN_SAMPLING),
        SAMPLING,
    )
    _Generate = with_rules(
        "GenerateRules",
        wire_struct("GenerateBeside", "native", GenerateFields, BESIDE_SAMPLING),
        GENERATE,
    )


class NativeSampling(_NativeSampling, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling_params; refused fields are checked by the request holding them."""


class GenerateRequest(_Generate, kw_only=True, forbid_unknown_fields=True):
    sampling_params: NativeSampling | list[NativeSampling] | None = None

    def __post_init__(self) -> None:
        refuse(self, GENERATE)
        given = self.sampling_params
        if isinstance(given, NativeSampling):
            refuse(given, SAMPLING, "sampling_params.")
        for i, native in enumerate(given if isinstance(given, list) else ()):
            refuse(native, SAMPLING, f"sampling_params[{i}].")


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str | None = None
    abort_all: bool | None = None


class MetaInfo(msgspec.Struct, omit_defaults=True):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float
    # [logprob, token_id, null] per output token; [[...] * top_logprobs_num] per token
    output_token_logprobs: list[tuple[float, int, None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, None]]] | None = None
    # The prompt's from logprob_start_len (empty without it), position 0's logprob null and
    # its top list null; the token_ids_logprob lists per position (position 0's null)
    input_token_logprobs: list[tuple[float | None, int, None]] | None = None
    input_top_logprobs: list[list[tuple[float, int, None]] | None] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int, None]] | None] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int, None]]] | None = None
    # return_routed_experts, the last event only: base64 of little-endian int32 [positions
    # routed_experts_start_len .. prompt + output - 2, num_hidden_layers, num_experts_per_tok]
    # (a dense layer's ids 0), and the start when it is not 0 (as SGLang answers)
    routed_experts: str | None = None
    routed_experts_start_len: int | None = None


class GenerateResponse(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
