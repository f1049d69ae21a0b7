"""Sampling parameters: one frozen struct per request, validated before anything is queued.

SamplingParams is the one declaration of the sampling vocabulary: every door takes each of its
fields, named as its wire names it (api/sampling_wire.py), with the default declared here, and
Engine.generate validates each request once (`validate`). `Bootstrap`, the other input of
Engine.generate, makes a request one half of a disaggregated pair.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import regex  # type: ignore[import-untyped]  # no stubs; re's syntax, and search timeouts

from shoal.limits import InputLimits, check_chars, check_count, check_stops
from shoal.results import RequestError

MAX_TOP_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token of one request.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    Penalties follow the OpenAI meaning for frequency/presence (over generated tokens) and the
    Hugging Face meaning for repetition_penalty (over prompt and generated tokens).
    logprobs / top_logprobs report the model's raw log-probabilities (before penalties, biases
    and temperature) of each chosen token and of its top alternatives.
    logprob_start_len asks for the prompt's logprobs too, from that position on (SGLang's
    meaning: -1 none, 0 the whole prompt, position 0's reported without a logprob since nothing
    precedes it; it must be below the prompt's length), each with top_logprobs alternatives;
    token_ids_logprob lists token ids whose logprobs are reported at every position reported
    (prompt and, with logprobs, output). docs/architecture.md, "Prompt logprobs".
    logit_bias adds its value to its token's logit at every step (OpenAI's meaning: -100 bans a
    token, +100 all but forces it), as the row constraint of kernels/logit_bias.py.
    include_stop_str_in_output keeps the stop string that ended the request at the end of its
    text (vLLM's name; SGLang's /generate calls it no_stop_trim); by default the text ends
    before it. A stop token id's own text is in the text either way, as vLLM answers.
    stop_regex (SGLang's) ends the request when the output's text matches a pattern (Python
    regular expressions, searched over the text's tail: actors/tokenizer/stop_regex.py); the
    text ends with the match, which stays in it whatever include_stop_str_in_output says.
    return_routed_experts (SGLang's, mixture-of-experts models only) answers every layer's
    top-k expert ids at positions [routed_experts_start_len, prompt + output - 1), a start
    in [0, the prompt's length] (docs/architecture.md, "Routed experts").
    json_schema, regex, ebnf and structural_tag (SGLang's names; at most one) constrain the
    output to a grammar compiled by xgrammar: a JSON schema (as JSON text), a regular
    expression, an EBNF grammar (GBNF, with a `root` rule) or an xgrammar structural tag (as
    JSON text); the request ends with "stop" where the grammar ends (kernels/grammar_row.py).

    This struct is the per-request spec: it travels whole from the door to the request's row
    (Generate, the scheduler's Request, RowInit, RowState), and every door takes every field
    (api/sampling_wire.py). An option that acts on the row's logits becomes a row constraint
    (kernels/constraints.py): docs/architecture.md, "A per-request option".
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] = {}
    logprob_start_len: int = -1
    token_ids_logprob: tuple[int, ...] = ()
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprob_start_len >= 0

    @property
    def grammar(self) -> GrammarSpec | None:
        """The one grammar constraint asked for (validate refuses more than one), or None."""
        for kind in GRAMMAR_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return GrammarSpec(kind, source)
        return None

    def validate(self, vocab_size: int | None = None, limits: InputLimits | None = None) -> None:
        """Raise RequestError (LimitExceeded for a count or a length) naming the first bad
        field in `field`; its message starts with the name. Counts and lengths are checked
        first, against `limits` (default: InputLimits())."""
        limits = limits or InputLimits()
        check_stops(limits, self.stop, self.stop_token_ids, self.stop_regex)
        check_count(len(self.logit_bias), limits.max_logit_bias, "logit_bias", "max_logit_bias")
        _check_grammar(self, limits)
        num_listed = len(self.token_ids_logprob)
        check_count(
            num_listed, limits.max_token_ids_logprob, "token_ids_logprob", "max_token_ids_logprob"
        )
        # 0: the prompt's prefill alone (its prompt logprobs), as SGLang answers
        _check(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0", self.max_new_tokens)
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            "must be in [0, max_new_tokens]",
            self.min_new_tokens,
        )
        _check(
            _finite(self.temperature) and 0.0 <= self.temperature <= 2.0,
            "temperature",
            "must be in [0, 2]",
            self.temperature,
        )
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 or >= 1", self.top_k)
        _check(
            _finite(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            "must be in (0, 1]",
            self.top_p,
        )
        _check(
            _finite(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            "must be in [0, 1]",
            self.min_p,
        )
        _check(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            "must be in (0, 2]",
            self.repetition_penalty,
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name, "must be in [-2, 2]", value)
        _check(
            self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)", self.seed
        )
        for stop in self.stop:
            _check(isinstance(stop, str) and stop != "", "stop", "entries must be non-empty", stop)
        for index, pattern in enumerate(self.stop_regex):
            problem = pattern_problem(pattern)
            if problem is not None:
                where = f" entry {index}" if len(self.stop_regex) > 1 else ""
                raise RequestError(f"{where} {problem}", "stop_regex", named=True)
        _check(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
            self.top_logprobs,
        )
        _check(
            self.logprob_start_len >= -1,
            "logprob_start_len",
            "must be -1 (no prompt logprobs) or a prompt position >= 0",
            self.logprob_start_len,
        )
        _check(
            self.routed_experts_start_len >= 0,
            "routed_experts_start_len",
            "must be a prompt position >= 0",
            self.routed_experts_start_len,
        )
        for name in ("stop_token_ids", "token_ids_logprob"):
            for token_id in getattr(self, name):
                ok = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
                _check(ok, name, "entries must be valid token ids", token_id)
        for token_id, bias in self.logit_bias.items():
            ok = isinstance(token_id, int) and token_id >= 0
            ok = ok and (vocab_size is None or token_id < vocab_size)
            _check(ok, "logit_bias", "keys must be valid token ids", token_id)
            ok = _finite(bias) and -100.0 <= bias <= 100.0
            _check(ok, "logit_bias", "values must be in [-100, 100]", bias)


GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarSpec(msgspec.Struct, frozen=True):
    """What a request's output must match: the field that asked (GRAMMAR_KINDS) and its text.
    Also the key of its compiled grammar (kernels/grammars.py)."""

    kind: str
    source: str


def _check_grammar(params: SamplingParams, limits: InputLimits) -> None:
    """At most one grammar field, each a non-empty string within max_grammar_chars; the JSON
    ones parse as JSON (what they mean is checked where they compile: kernels/grammars.py)."""
    given = [kind for kind in GRAMMAR_KINDS if getattr(params, kind) is not None]
    if len(given) > 1:
        raise RequestError(
            f"give at most one of json_schema, regex, ebnf and structural_tag, got {given}",
            given[1],
        )
    for kind in given:
        source = getattr(params, kind)
        _check(isinstance(source, str) and source != "", kind, "must be a non-empty string", source)
        check_chars(len(source), limits.max_grammar_chars, kind, "max_grammar_chars")
        if kind in ("json_schema", "structural_tag"):
            try:
                json.loads(source)
            except (ValueError, RecursionError) as exc:
                raise RequestError(f" is not valid JSON: {exc}", kind, named=True) from None


def pattern_problem(pattern: object) -> str | None:
    """Why `pattern` is not a regular expression stop_regex can search for (None: it is): it
    does not compile, or it matches the empty text.
    The `regex` package's V0 syntax (Python's `re`'s); it caches compiled patterns, so
    the tokenizer actor's compile of the same pattern costs nothing more."""
    if not isinstance(pattern, str):
        return f"must be a string, got {type(pattern).__name__}"
    try:
        compiled = regex.compile(pattern)
    except (regex.error, ValueError, OverflowError, RecursionError) as exc:
        return f"is not a valid regular expression: {exc}"
    if compiled.search("") is not None:  # "a*", ".*", "$": every request would end at once
        return "matches the empty text, so it would end every request at its first token"
    return None


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise RequestError(f" {rule}, got {value!r}", field, named=True)


class RoomLeft(msgspec.Struct, frozen=True):
    """max_new_tokens as the room the prompt leaves in the context, at most `at_most` (None:
    all of it): a door's rule for a max_new_tokens it was not given (OpenAI's: all the room;
    /generate's: the declared default, capped at the room). Engine.generate takes it as
    `max_new_tokens=RoomLeft(...)`; the tokenizer actor sizes it where it measures the prompt
    (actors/tokenizer/encode.py, `checked`)."""

    at_most: int | None = None


# apply_chat_template's own arguments: a template variable may not take their names
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
        "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
        "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
    }
)  # fmt: skip


class ChatTemplateArgs(msgspec.Struct, frozen=True):
    """What a chat request hands its model's template beside the messages: the tools it may
    call (OpenAI's {"type": "function", "function": {...}} each) and the caller's template
    variables (chat_template_kwargs, such as Qwen3's {"enable_thinking": false})."""

    tools: tuple[dict[str, Any], ...] = ()
    kwargs: dict[str, Any] = {}

    def check(self) -> None:
        """RequestError naming chat_template_kwargs when a variable takes the name of one of
        apply_chat_template's own arguments."""
        taken = sorted(set(self.kwargs) & _TEMPLATE_ARGUMENTS)
        if taken:
            why = f" may not set {taken}: the server sets them"
            raise RequestError(why, "chat_template_kwargs", named=True)


class Bootstrap(msgspec.Struct, frozen=True):
    """Prefill/decode disaggregation (docs/disaggregation.md): where this request's other
    half runs. SGLang's names: the prefill server's bootstrap host and port, and the room
    both servers know the request by."""

    host: str
    port: int
    room: int
