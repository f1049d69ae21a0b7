"""EXAMPLES holds a valid value, not the default, for every SamplingParams field: tests/api/
test_sampling_doors.py sends them all through every door (OpenAI, /generate, the websocket, the
command line, Engine.generate, Session.turn), and tests/kernels/test_sampling.py fails until a
new field has one here.
"""

from __future__ import annotations

from typing import Any

EXAMPLES: dict[str, Any] = {
    "max_new_tokens": 3,
    "min_new_tokens": 1,
    "temperature": 0.5,
    "top_k": 4,
    "top_p": 0.9,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.2,
    "presence_penalty": 0.3,
    "seed": 7,
    "stop": ("zzqq",),
    "stop_token_ids": (3,),
    "stop_regex": ("q{3}z",),
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "logprobs": True,
    "top_logprobs": 2,
    "logit_bias": {5: 1.5, 9: -2.0},
    "logprob_start_len": 1,  # the prompts the doors test with are longer
    "token_ids_logprob": (4, 8),
    # a mixture-of-experts model's alone: the doors' test (dense) sends them as their default
    "return_routed_experts": True,
    "routed_experts_start_len": 1,
    "regex": "[a-z ]+",  # the grammar fields exclude each other: GRAMMAR_EXAMPLES has the rest
}

# A value of each grammar field (params.GRAMMAR_KINDS), which exclude each other: EXAMPLES
# carries the regex, and tests/api/test_sampling_doors.py sends each in its place.
GRAMMAR_EXAMPLES: dict[str, str] = {
    "json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}',
    "regex": EXAMPLES["regex"],
    "ebnf": 'root ::= [a-z ]+ "."',
    "structural_tag": (
        '{"type": "structural_tag", "format": {"type": "const_string", "value": "ab"}}'
    ),
}
