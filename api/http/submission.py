"""What a door hands the gateway: one typed submission per HTTP request or websocket turn.

    choices = [Choice("cmpl-…-0", PromptInput("prompt[0]", text="Once"), sampling, RoomLeft())]
    submission = Submission("cmpl-…", choices, arrived_at, names, rooms=body)
    async with gateway.submit(submission) as job:        # api/http/job.py
        ...

Each door turns its body into one (openai_routes.py, native.py, ws_sessions.py); the gateway
starts one engine request per choice through Engine.generate, which the engine's tokenizer
actor encodes and measures (the one place a prompt is measured, off the event loop). A door
counts what it must count before it reads it (characters, messages, stop strings) and names
its fields; it neither encodes nor sizes anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.api.http.bootstrap_fields import RoomFields
from shoal.api.http.errors import FieldNames
from shoal.params import ChatTemplateArgs, RoomLeft, SamplingParams


@dataclass(frozen=True, kw_only=True)
class PromptInput:
    """One choice's prompt as the body gave it (exactly one of text, input_ids, messages), and
    the body's name for it ("messages", "prompt[1]", "input_ids")."""

    name: str
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    template: ChatTemplateArgs | None = None  # with messages: the template's tools and kwargs


@dataclass(frozen=True)
class Choice:
    """One engine request: its id, prompt and sampling. `room`: the body gave no max tokens,
    and the door's rule sizes them where the prompt is measured (params.RoomLeft)."""

    rid: str
    prompt: PromptInput
    sampling: SamplingParams
    room: RoomLeft | None = None


@dataclass(frozen=True)
class Submission:
    """One HTTP request's engine requests (n choices, or a batch of prompts), or a session's
    next turn (`session_id`: exactly one choice, its prompt only the new input)."""

    public_id: str  # what /abort_request knows it by
    choices: Sequence[Choice]
    arrived_at: float  # time.monotonic() at its arrival: the metrics' clock
    names: FieldNames  # the door's names of the engine's fields (the prompt's: each choice's)
    session_id: str | None = None
    rooms: RoomFields | None = None  # SGLang's disaggregation fields (bootstrap_fields.py)

    def names_of(self, choice: Choice) -> FieldNames:
        """The door's names for this choice: its own prompt field."""
        return FieldNames(choice.prompt.name, self.names.session, self.names.sampling)
