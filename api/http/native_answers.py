"""What /generate answers: one whole object per prompt, or the events of a stream.

    whole(completion, arrived_at, wanted)            # the non-streamed answer
    chunks = StreamChunks(rid, num_prompt, version, arrived_at, wanted, incremental)
    chunks.delta(0, delta) ... chunks.finish(0, completion)   # one event each: a StreamFormat
                                                              # (api/http/relay.py)

A stream's events, as SGLang sends them:

    cumulative (the default)   each event: the text, output ids and logprobs so far
    incremental                each event: only what is new since the previous one
    (--incremental-streaming-output)

Both carry the cumulative counts (prompt_tokens, completion_tokens) in meta_info, and the last
event the finish_reason. Incremental events concatenate to the whole answer (text, output_ids,
output_token_logprobs, output_top_logprobs): a stream's bytes grow linearly with its tokens.
Cumulative ones cannot (every event repeats the ones before: quadratic), but the work per
event is only the new tokens' plus encoding: the lists so far are kept and extended, not
rebuilt, so an event must be encoded before the next delta arrives (SseStream.event does).
"""

from __future__ import annotations

import base64
import time
from typing import Any, NamedTuple

from shoal.api.http.native_protocol import GenerateResponse, MetaInfo
from shoal.results import Completion, Delta, PromptLogprobs, TokenLogprob

TokenRow = tuple[float, int, None]  # [logprob, token_id, null], as SGLang reports them
PromptRow = tuple[float | None, int, None]  # position 0's logprob is null


class Wanted(NamedTuple):
    """The logprobs a request asked for: return_logprob, top_logprobs_num > 0, the
    token_ids_logprob ids; and its routed_experts_start_len (echoed when not 0)."""

    logprobs: bool
    top: bool
    ids: tuple[int, ...] = ()
    routed_start: int = 0


class PromptRows(NamedTuple):
    """meta_info's input_* lists of one request, made once (a stream repeats them)."""

    tokens: list[PromptRow]
    top: list[list[TokenRow] | None]
    ids: list[list[TokenRow] | None]

    @classmethod
    def of(cls, prompt: PromptLogprobs | None, wanted: Wanted) -> PromptRows:
        """SGLang's lists from logprob_start_len: [] when none were asked; position 0 (when
        the start is 0) with a null logprob, a null top list and null listed ids."""
        if prompt is None:
            return cls([], [], [])
        first = prompt.first_token_id
        tokens: list[PromptRow] = [] if first is None else [(None, first, None)]
        nulls: list[list[TokenRow] | None] = [] if first is None else [None]
        tokens += _token_rows(prompt.items)
        top = nulls + list(_top_rows(prompt.items)) if wanted.top else []
        ids = nulls + list(_listed_rows(prompt.items, wanted.ids)) if wanted.ids else []
        return cls(tokens, top, ids)

    def into(self, meta: MetaInfo, wanted: Wanted) -> None:
        meta.input_token_logprobs = self.tokens
        if wanted.top:
            meta.input_top_logprobs = self.top
        if wanted.ids:
            meta.input_token_ids_logprobs = self.ids


def finish_reason(c: Completion) -> dict[str, object]:
    match c.finish_reason:
        case "stop":
            return {"type": "stop", "matched": c.matched_stop}
        case "length":
            return {"type": "length", "length": c.usage.completion_tokens}
        case reason:
            return {"type": "abort", "message": c.message or reason}


def whole(c: Completion, arrived_at: float, wanted: Wanted) -> GenerateResponse:
    meta = _meta(c.rid, finish_reason(c), c, arrived_at)
    if wanted.logprobs:
        items = c.logprobs or ()
        meta.output_token_logprobs = _token_rows(items)
        if wanted.top:
            meta.output_top_logprobs = _top_rows(items)
        if wanted.ids:
            meta.output_token_ids_logprobs = _listed_rows(items, wanted.ids)
        PromptRows.of(c.prompt_logprobs, wanted).into(meta, wanted)
    _routed_experts(meta, c, wanted)
    return GenerateResponse(c.text, list(c.token_ids), meta)


class StreamChunks:
    """One /generate stream's events, cumulative or incremental."""

    def __init__(
        self,
        rid: str,
        num_prompt: int,
        weight_version: str,
        arrived_at: float,
        wanted: Wanted,
        incremental: bool,
    ) -> None:
        self.rid = rid
        self.num_prompt = num_prompt
        self.weight_version = weight_version  # fixed while the request is held (law 2)
        self.arrived_at = arrived_at
        self.wanted = wanted
        self.incremental = incremental
        # Sent so far. Cumulative: the event bodies share these lists (see the docstring).
        self.text = ""
        self.num_text_chars = 0
        self.num_logprobs = 0
        self.ids: list[int] = []
        self.token_rows: list[TokenRow] = []
        self.top_rows: list[list[TokenRow]] = []
        self.ids_rows: list[list[TokenRow]] = []
        # The prompt's, from the first delta: every cumulative event, the first incremental one
        self.prompt: PromptRows | None = None

    def first(self, index: int) -> None:
        return None

    def last(self, completions: list[Completion]) -> None:
        return None

    def delta(self, index: int, d: Delta) -> GenerateResponse:
        items = d.logprobs or ()
        new_ids = list(d.token_ids)
        wanted = self.wanted
        token_rows = _token_rows(items) if wanted.logprobs else []
        top_rows = _top_rows(items) if wanted.logprobs and wanted.top else []
        ids_rows = _listed_rows(items, wanted.ids) if wanted.logprobs and wanted.ids else []
        self.num_text_chars += len(d.text)
        self.num_logprobs += len(items)
        first = self.prompt is None
        if first:
            self.prompt = PromptRows.of(d.prompt_logprobs, wanted)
        if self.incremental:
            self.ids += new_ids
            chunk = self._chunk(d.text, new_ids, token_rows, top_rows, ids_rows, first)
            return chunk
        self.text += d.text
        self.ids += new_ids
        self.token_rows += token_rows
        self.top_rows += top_rows
        self.ids_rows += ids_rows
        rows = (self.token_rows, self.top_rows, self.ids_rows)
        return self._chunk(self.text, self.ids, *rows, True)

    def finish(self, index: int, c: Completion) -> GenerateResponse:
        """The last event: with its finish_reason and the Completion's own counts. The
        Completion's text, ids and logprobs are its deltas' (actors/tokenizer/output.py), so the
        incremental event carries what is left of them: nothing, unless a delta never came."""
        if not self.incremental:
            return whole(c, self.arrived_at, self.wanted)
        items = (c.logprobs or ())[self.num_logprobs :]
        rest = GenerateResponse(
            c.text[self.num_text_chars :],
            list(c.token_ids[len(self.ids) :]),
            _meta(c.rid, finish_reason(c), c, self.arrived_at),
        )
        wanted = self.wanted
        if wanted.logprobs:
            rest.meta_info.output_token_logprobs = _token_rows(items)
            if wanted.top:
                rest.meta_info.output_top_logprobs = _top_rows(items)
            if wanted.ids:
                rest.meta_info.output_token_ids_logprobs = _listed_rows(items, wanted.ids)
            if self.prompt is None:  # no delta came (max_new_tokens 0): the prompt's here
                PromptRows.of(c.prompt_logprobs, wanted).into(rest.meta_info, wanted)
        _routed_experts(rest.meta_info, c, wanted)
        return rest

    def _chunk(
        self,
        text: str,
        ids: list[int],
        token_rows: list[TokenRow],
        top_rows: list[list[TokenRow]],
        ids_rows: list[list[TokenRow]],
        with_prompt: bool,
    ) -> GenerateResponse:
        meta = MetaInfo(
            self.rid,
            None,  # finish_reason: only the last event's
            self.num_prompt,
            len(self.ids),
            0,
            self.weight_version,
            time.monotonic() - self.arrived_at,
        )
        wanted = self.wanted
        if wanted.logprobs:
            meta.output_token_logprobs = token_rows
            if wanted.top:
                meta.output_top_logprobs = top_rows
            if wanted.ids:
                meta.output_token_ids_logprobs = ids_rows
            if with_prompt and self.prompt is not None:
                self.prompt.into(meta, wanted)
        return GenerateResponse(text, ids, meta)


def _meta(rid: str, reason: dict[str, Any], c: Completion, arrived_at: float) -> MetaInfo:
    usage = c.usage
    return MetaInfo(
        rid,
        reason,
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        c.weight_version,
        time.monotonic() - arrived_at,
    )


def _routed_experts(meta: MetaInfo, c: Completion, wanted: Wanted) -> None:
    """SGLang's routed_experts (the finished answer's only): base64 of the int32 rows, and
    routed_experts_start_len when not 0 (slime reads it with a default of 0)."""
    if c.routed_experts is not None:
        meta.routed_experts = base64.b64encode(c.routed_experts).decode("ascii")
        if wanted.routed_start:
            meta.routed_experts_start_len = wanted.routed_start


def _token_rows(items: tuple[TokenLogprob, ...]) -> list[TokenRow]:
    return [(t.logprob, t.token_id, None) for t in items]


def _listed_rows(items: tuple[TokenLogprob, ...], ids: tuple[int, ...]) -> list[list[TokenRow]]:
    """Each position's token_ids_logprob rows, in the order the ids were given."""
    return [[(lp, i, None) for i, lp in zip(ids, t.listed, strict=True)] for t in items]


def _top_rows(items: tuple[TokenLogprob, ...]) -> list[list[TokenRow]]:
    return [[(lp, i, None) for i, lp in t.top] for t in items]
