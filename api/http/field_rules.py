"""Fields a door knows but does not honour: refused with a 400 naming them, or taken because
they cannot change the answer. No field that changes what is generated is silently ignored.

Every field of SGLang's, vLLM's and OpenAI's request types is, at every door, honoured (the
wire structs map it), accepted (an `Accepted` rule) or refused (a `Refused` rule, or a field
the door does not know at all: the wire structs forbid unknown fields, as OpenAI's API does).
Each door's rules are in api/http/door_rules.py, the reasons they give here;
tests/api/http/test_http_fields.py holds the upstream lists and checks every door.

    Refused(why, neutral)  400 "<field> is not supported<why>", param the field, code
                           "invalid_value"; unless the value is null or one of `neutral`, the
                           values that ask for nothing ("tools": [], "tool_choice": "none")
    Accepted(why)          taken and ignored: it changes neither the tokens nor the answer

    Chat = with_rules("ChatRules", base, CHAT)    # each rule's field not in base: `Any = None`
    refuse(body, CHAT)                            # the first refused field: ApiError 400

The OpenAI routes refuse in refuse_unsupported (after the size checks, so a refused field is
counted first); /generate, its sampling_params, session_params and the websocket's turn
refuse as they are decoded (their __post_init__).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, NamedTuple

import msgspec

from shoal.api.http.errors import bad_request


class Refused(NamedTuple):
    why: str  # the message: "<field> is not supported" + why (" yet: ..." or ": ...")
    neutral: tuple[Any, ...] = ()  # JSON values that ask for nothing (null always does)

    def asks_nothing(self, value: Any) -> bool:
        """True for a value that changes nothing: null, or one of `neutral` (as JSON, and a
        bool only matches a bool)."""
        if value is None:
            return True
        sent = msgspec.to_builtins(value)
        return any(
            sent == quiet and isinstance(sent, bool) == isinstance(quiet, bool)
            for quiet in self.neutral
        )


class Accepted(NamedTuple):
    why: str  # why it cannot change the answer


Rules = Mapping[str, Refused | Accepted]


def with_rules(
    name: str, base: type[msgspec.Struct], rules: Rules, **config: Any
) -> type[msgspec.Struct]:
    """A subclass of `base` declaring each rule's field that `base` does not, as `Any = None`
    documented by its rule (the schema of a refused one lists the values it takes)."""
    declared = set(base.__struct_fields__)
    specs = [(f, _annotation(rule), None) for f, rule in rules.items() if f not in declared]
    return msgspec.defstruct(
        name, specs, bases=(base,), module=base.__module__, kw_only=True, **config
    )


def _annotation(rule: Refused | Accepted) -> Any:
    if isinstance(rule, Accepted):
        return Annotated[Any, msgspec.Meta(description=f"accepted and ignored: {rule.why}")]
    values = [None, *rule.neutral]
    taken = msgspec.json.encode(values).decode()
    meta = msgspec.Meta(
        description=f"not supported{rule.why}; accepted only as one of {taken}",
        extra_json_schema={"enum": values},
    )
    return Annotated[Any, meta]


def refuse(body: Any, rules: Rules, prefix: str = "") -> None:
    """ApiError 400 naming the first field of `rules` the body gives a value that asks for
    something the door does not do. `prefix`: where the body sits ("sampling_params.")."""
    for field, rule in rules.items():
        if isinstance(rule, Refused) and not rule.asks_nothing(getattr(body, field, None)):
            param = prefix + field
            raise bad_request(f"{param} is not supported{rule.why}", param)


# ---- why ------------------------------------------------------------------------------------

STRUCTURED = Refused(
    ": a JSON schema's whitespace is the server's (--json-any-whitespace), not a pattern's"
)
TOOLS = ": OpenAI's legacy functions; send tools and tool_choice"
LOGITS = " yet: shoal biases logits per request (logit_bias) but does not mask or process them"
PROMPT = ": shoal renders the prompt from the messages alone, with the model's chat template"
ANSWER = ": the answer does not carry it"
INPUTS = ": only text and token ids are taken as input"
ADAPTER = Refused(": shoal serves the model's own weights, without adapters")
CACHE_SALT = Refused(
    ": the prefix cache is shared by every request, so a salt would isolate nothing", ("",)
)
PRIORITY = Refused(": requests are scheduled first come, first served", (0,))
REPETITION = Refused(": generation does not stop on a repeated pattern", (0,))
THINKING = ": shoal neither separates nor budgets reasoning"
NOT_OUTPUT = Refused(ANSWER, (False,))
