"""Every door's spelling of the sampling vocabulary, and the one way back into SamplingParams.

SamplingParams (params.py) declares the sampling fields and their defaults once. Every door
takes every field (but the prompt logprobs' two and the routed experts' two, NATIVE_ONLY,
/generate's alone): its wire struct gets them from the declaration (`wire_struct`), each as
`T | None = None` (None: not given, so the declared default, unless the door has a rule of
its own), under the name the door gives it.
WIRE_NAMES lists only the names that differ:

    door            where the fields are                 names that differ
    chat            the body of /v1/chat/completions     max_tokens, min_tokens (prompt
                                                         logprobs: vLLM's prompt_logprobs)
    completions     the body of /v1/completions          max_tokens, min_tokens, logprobs (an
                                                         int: top_logprobs; logprobs implied;
                                                         prompt logprobs: echo, prompt_logprobs)
    native          /generate's sampling_params; the     return_logprob, top_logprobs_num,
                    logprob and routed experts fields    no_stop_trim
                    beside it, as SGLang
    websocket       the turn message                     none (and no prompt logprobs)
    CLI             `generate` flags (add_sampling_flags) --max-new-tokens, --no-ignore-eos, ...
                    (greedy unless --temperature is given)
    Python          Engine.generate, Session.turn        none (keywords)

    values = wire_values(body, "chat")     # {SamplingParams field: value}, the ones given
    sampling = sampling_from(values)       # the one conversion; Engine.generate validates it

What stays with a door is its own rules: OpenAI's max_tokens defaults to the room left in the
context, /generate's max_new_tokens to the declared default capped at that room, `generate` on
the command line answers greedily, and aliases (OpenAI's max_completion_tokens, the websocket's
max_tokens, SGLang's sampling_seed).
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, get_args, get_origin

import msgspec

from shoal.params import SamplingParams

SAMPLING_FIELDS: tuple[str, ...] = SamplingParams.__struct_fields__
DEFAULT_SAMPLING = SamplingParams()
# The logprob fields. OpenAI: per endpoint (the prompt's: the doors' rules, echo and vLLM's
# prompt_logprobs); /generate: beside sampling_params, as SGLang has them.
LOGPROBS = ("logprobs", "top_logprobs", "logprob_start_len", "token_ids_logprob")
# A mixture-of-experts model's routing (SamplingParams.return_routed_experts): /generate only,
# beside sampling_params, as SGLang has them.
ROUTED_EXPERTS = ("return_routed_experts", "routed_experts_start_len")
BESIDE_SAMPLING = LOGPROBS + ROUTED_EXPERTS  # /generate's fields outside sampling_params
IN_SAMPLING = tuple(field for field in SAMPLING_FIELDS if field not in BESIDE_SAMPLING)
ONE_OR_MORE = ("stop", "stop_regex")  # a list, or one string for a list of one

# The prompt's logprobs (SamplingParams.logprob_start_len, token_ids_logprob): SGLang's names
# on /generate; the OpenAI doors ask with their own fields (echo, vLLM's prompt_logprobs:
# openai_params.py), the websocket with none. The routed experts: /generate alone (the OpenAI
# doors refuse return_routed_experts: api/http/door_rules.py).
NATIVE_ONLY = {
    "logprob_start_len": None,
    "token_ids_logprob": None,
    "return_routed_experts": None,
    "routed_experts_start_len": None,
}

# door -> {SamplingParams field: the door's name for it}, only where it differs. None: the
# door has no name of its own for the field; a rule of the door sets it, or it keeps its
# declared default.
WIRE_NAMES: Mapping[str, Mapping[str, str | None]] = {
    "chat": {
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
        **NATIVE_ONLY,
    },
    "completions": {
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
        "logprobs": None,  # asked for by any value of the next
        "top_logprobs": "logprobs",
        **NATIVE_ONLY,
    },
    "native": {
        "logprobs": "return_logprob",
        "top_logprobs": "top_logprobs_num",
        "include_stop_str_in_output": "no_stop_trim",
    },
    "websocket": {**NATIVE_ONLY},
}


def wire_struct(
    name: str,
    door: str,
    base: type[msgspec.Struct],
    fields: Iterable[str] = SAMPLING_FIELDS,
    **config: Any,
) -> type[msgspec.Struct]:
    """A subclass of `base` holding the door's sampling `fields`, each `T | None = None` under
    its wire name; a stop or stop_regex may be one string. `config`: msgspec's struct options."""
    kinds = {info.name: info.type for info in msgspec.structs.fields(SamplingParams)}
    names = WIRE_NAMES[door]
    specs: list[tuple[str, Any, None]] = []
    for field in fields:
        wire = names.get(field, field)
        if wire is not None:
            kind = str | kinds[field] if field in ONE_OR_MORE else kinds[field]
            specs.append((wire, kind | None, None))
    module = base.__module__
    return msgspec.defstruct(name, specs, bases=(base,), module=module, kw_only=True, **config)


def wire_values(
    body: msgspec.Struct, door: str, fields: Iterable[str] = SAMPLING_FIELDS
) -> dict[str, Any]:
    """{SamplingParams field: value} for each of `fields` the body gives (not None)."""
    names = WIRE_NAMES[door]
    values = {}
    for field in fields:
        wire = names.get(field, field)
        value = None if wire is None else getattr(body, wire, None)
        if value is not None:
            values[field] = value
    return values


def wire_names(
    door: str, prefix: str = "", fields: Iterable[str] = SAMPLING_FIELDS
) -> dict[str, str]:
    """{SamplingParams field: the door's name for it}, to name a refused field as sent."""
    names = WIRE_NAMES[door]
    return {field: prefix + (names.get(field) or field) for field in fields}


def sampling_from(values: Mapping[str, Any]) -> SamplingParams:
    """The one conversion into SamplingParams, for every door: a field not given takes its
    declared default, and one stop string (or stop_regex pattern) is a list of one. Not
    validated here: Engine.generate validates each request, once. ValueError for a value of the
    wrong type."""
    for field in ONE_OR_MORE:
        if isinstance(values.get(field), str):
            values = {**values, field: (values[field],)}
    try:
        return msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid sampling option: {exc}") from None


# ---- the command line -------------------------------------------------------------------------


def add_sampling_flags(parser: argparse.ArgumentParser, **door_defaults: Any) -> None:
    """A flag per SamplingParams field, named after it: `--top-k 5`, `--stop S` (again for
    more), `--ignore-eos` / `--no-ignore-eos`, `--logit-bias 5=-100` (again for more). A flag
    not given keeps the declared default, or the command's own where it has a rule of its own
    (`door_defaults`)."""
    group = parser.add_argument_group("sampling (SamplingParams; a flag not given: its default)")
    for info in msgspec.structs.fields(SamplingParams):
        flag = "--" + info.name.replace("_", "-")
        kind = info.type
        if isinstance(kind, types.UnionType):  # int | None: an int
            kind = next(k for k in get_args(kind) if k is not type(None))
        says = f"default {door_defaults.get(info.name, info.default)!r}"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=says)
        elif get_origin(kind) is tuple:
            item = get_args(kind)[0]
            group.add_argument(flag, action="append", type=item, help=says + "; repeat for more")
        elif get_origin(kind) is dict:
            key, value = get_args(kind)
            pair = _pair_parser(key, value)
            group.add_argument(flag, action="append", type=pair, help=says + "; KEY=VALUE, again")
        else:
            group.add_argument(flag, type=kind, help=says)
    parser.set_defaults(**door_defaults)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams the flags of add_sampling_flags ask for."""
    given = {field: getattr(args, field) for field in SAMPLING_FIELDS}
    kinds = {info.name: info.type for info in msgspec.structs.fields(SamplingParams)}
    values = {field: value for field, value in given.items() if value is not None}
    for field, value in values.items():
        if get_origin(kinds[field]) is dict:  # the KEY=VALUE pairs, in order: the last wins
            values[field] = dict(value)
    return sampling_from(values)


def _pair_parser(key: type, value: type) -> Callable[[str], tuple[Any, Any]]:
    """argparse's type for one KEY=VALUE flag of a dict field."""

    def pair(text: str) -> tuple[Any, Any]:
        left, equals, right = text.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
        try:
            return key(left), value(right)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {key.__name__}={value.__name__}, got {text!r}"
            ) from None

    return pair
