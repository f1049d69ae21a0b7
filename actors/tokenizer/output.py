"""The tokenizer actor's way out: each live request's tokens into text, cut at its stop
strings, pushed into its caller's stream, which ends with a Completion
(docs/architecture.md, "Out: detokenize, stop strings, the stream").

    streams.open(gen, ids, sampling, version, session) # at admission
    streams.deliver_steady(outputs.steady_rids, outputs.steady_tokens)  # then
    streams.deliver_all(outputs.items)                # every Outputs the scheduler sends
    streams.fail(rid, error)                          # ends it with an error, if live

A request is live here from its admission until its stream ends (its last token, a stop
string, a failure); it stays a reader of the update lock until Released, which is not this
file's business. A stop string ends the stream at once and tells the scheduler to end the
request (Abort, reason "stop"); tokens still arriving for it are dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Abort, Generate, Output, SchedulerMsg
from shoal.actors.tokenizer.detokenizers import Detokenizer, Detokenizers
from shoal.actors.tokenizer.routed_rows import RoutedRows
from shoal.actors.tokenizer.sessions import SessionBook, SessionState
from shoal.actors.tokenizer.stop_regex import StopPatterns, StopRegexTimeout
from shoal.actors.tokenizer.stops import StopMatcher
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.params import SamplingParams
from shoal.results import (
    Completion,
    Delta,
    ErrorCode,
    FinishReason,
    PromptLogprobs,
    RequestStream,
    TokenLogprob,
    Usage,
)


@dataclass
class Live:
    stream: RequestStream
    detok: Detokenizer
    stops: StopMatcher
    num_prompt: int
    plain: bool  # no stop strings or patterns: a steady output's text goes out as it comes
    keep_stop: bool = False  # the matched stop string stays in the text
    output_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    weight_version: str = "0"
    session: SessionState | None = None
    patterns: StopPatterns | None = None  # stop_regex (stop_regex.py)
    # Prompt logprobs, when asked (SamplingParams.logprob_start_len): from this position, its
    # first token (position 0's, which has no logprob), the items so far; they go out whole
    # with the first Delta (`prompt_sent`) and the Completion.
    prompt_start: int = -1
    first_prompt_id: int | None = None
    prompt_items: list[TokenLogprob] = field(default_factory=list)
    prompt_sent: bool = False
    routed: RoutedRows | None = None  # return_routed_experts: with the Completion alone

    def prompt_logprobs(self) -> PromptLogprobs | None:
        if self.prompt_start < 0:
            return None
        return PromptLogprobs(self.prompt_start, self.first_prompt_id, tuple(self.prompt_items))


def aborted_before_admission(gen: Generate, message: str) -> None:
    """End the stream of a request aborted while it queued (nothing of it was computed)."""
    usage = Usage(0, 0, 0)
    gen.stream.finish(Completion(gen.rid, "", (), "abort", usage, None, message))


class RequestStreams:
    """Every live request's stream and what its text needs: detokenizer, stop matcher."""

    def __init__(
        self, tokenizer: HFTokenizer, scheduler: Mailbox[SchedulerMsg], sessions: SessionBook
    ) -> None:
        self.detokenizers = Detokenizers(tokenizer)  # each request's, chosen once
        self.scheduler = scheduler
        self.sessions = sessions  # a turn's end becomes its session's history
        self.live: dict[str, Live] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self.live

    def rids(self) -> Iterator[str]:
        return iter(self.live)

    def has_stream(self, rid: str, stream: RequestStream) -> bool:
        """This live request is the one with this stream (not another with its id)."""
        live = self.live.get(rid)
        return live is not None and live.stream is stream

    def open(
        self,
        gen: Generate,
        ids: list[int],
        sampling: SamplingParams,
        weight_version: str,
        session: SessionState | None,
    ) -> None:
        """Book an admitted request (its measured prompt and sampling): its output is decoded
        after its prompt."""
        detok = self.detokenizers.open(ids, sampling.skip_special_tokens)
        stops = StopMatcher(sampling.stop)
        plain = not sampling.stop and not sampling.stop_regex
        live = Live(gen.stream, detok, stops, len(ids), plain)
        live.patterns = StopPatterns(sampling.stop_regex) if sampling.stop_regex else None
        live.keep_stop = sampling.include_stop_str_in_output
        live.logprobs = [] if sampling.wants_logprobs else None
        live.prompt_start = sampling.logprob_start_len
        live.first_prompt_id = ids[0] if sampling.logprob_start_len == 0 else None
        if sampling.return_routed_experts:
            live.routed = RoutedRows(sampling.routed_experts_start_len)
        live.weight_version = weight_version
        live.session = session
        self.live[gen.rid] = live

    def restamp(self, weight_version: str) -> None:
        """A weight update landed while these requests were parked across it: what they
        generate next comes from the new weights, and their Completions say so."""
        for live in self.live.values():
            live.weight_version = weight_version

    def deliver_steady(self, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """A steady step's outputs as columns (`Outputs.steady_rids`): one token for each
        request and nothing else to tell; one without stop strings takes the short way."""
        live_of = self.live.get
        for rid, token in zip(rids, tokens, strict=True):
            live = live_of(rid)
            if live is None:
                continue  # its stream already ended on a stop string; late tokens are dropped
            ids = (token,)
            if live.plain:
                live.output_ids.append(token)
                text = live.detok.push(ids)
                live.text.append(text)
                live.stream.push(Delta(text, ids))
            else:
                self.deliver(Output(rid, ids))

    def deliver_all(self, items: Sequence[Output]) -> None:
        """A step's outputs. A steady one (its tokens and nothing else to tell: no finish, no
        logprobs, no cached count) of a request without stop strings takes the short way:
        the ids, their text, one Delta, as `deliver` would do them."""
        live_of = self.live.get
        for item in items:
            live = live_of(item.rid)
            if live is None:
                continue  # its stream already ended on a stop string; late tokens are dropped
            ids = item.token_ids
            bare = item.logprobs is None and item.routed_experts is None
            steady = item.finish is None and bare and ids
            if steady and live.plain and item.num_cached_tokens is None:
                live.output_ids += ids
                text = live.detok.push(ids)
                live.text.append(text)
                live.stream.push(Delta(text, ids))
            else:
                self.deliver(item)

    def deliver(self, item: Output) -> None:
        live = self.live.get(item.rid)
        if live is None:
            return  # its stream already ended on a stop string; late tokens are dropped
        if item.num_cached_tokens is not None:
            live.num_cached_tokens = item.num_cached_tokens
        if item.routed_experts is not None and live.routed is not None:
            live.routed.place(item.routed_experts)
        live.output_ids.extend(item.token_ids)
        text = live.detok.push(item.token_ids) if item.token_ids else ""
        if item.finish in ("stop", "length"):
            text += live.detok.flush()
        try:
            hit = live.patterns.push(text) if live.patterns is not None and text else None
        except StopRegexTimeout as exc:
            self.scheduler.put(Abort(item.rid, reason="stop", keep_outputs=len(live.output_ids)))
            self.end(item.rid, "error", None, str(exc), "invalid_value")
            return
        if hit is not None:  # the text ends with the match; a stop string ending in it wins
            text = text[: hit.keep]
        emit, matched = live.stops.push(text) if text else ("", None)
        if matched is None and (item.finish is not None or hit is not None):
            emit += live.stops.flush()
        elif matched is not None and live.keep_stop:
            emit += matched
        if matched is None and hit is not None:
            matched = hit.pattern  # SGLang's FINISHED_MATCHED_REGEX: {"matched": the pattern}
        if item.logprobs is not None and live.logprobs is not None:
            live.logprobs.extend(item.logprobs)
        if item.prompt_logprobs is not None:
            live.prompt_items.extend(item.prompt_logprobs)
        if emit or item.token_ids:
            live.text.append(emit)
            prompt = None if live.prompt_sent else live.prompt_logprobs()
            live.prompt_sent = True
            live.stream.push(Delta(emit, item.token_ids, item.logprobs, prompt))
        if matched is not None:
            kept = len(live.output_ids)
            self.scheduler.put(Abort(item.rid, reason="stop", keep_outputs=kept))
            self.end(item.rid, "stop", matched)
        elif item.finish is not None:
            self.end(item.rid, item.finish, item.matched_token, item.message, item.code)

    def end(
        self,
        rid: str,
        reason: FinishReason,
        matched: str | int | None,
        message: str = "",
        code: ErrorCode | None = None,
    ) -> None:
        live = self.live.pop(rid)
        if live.session is not None:
            self.sessions.ended(live.session, "".join(live.text), live.output_ids, reason)
        usage = Usage(live.num_prompt, len(live.output_ids), live.num_cached_tokens)
        logprobs = tuple(live.logprobs) if live.logprobs is not None else None
        routed = None
        if live.routed is not None and reason != "error":
            routed = live.routed.answer(live.num_prompt + len(live.output_ids))
        completion = Completion(
            rid,
            "".join(live.text),
            tuple(live.output_ids),
            reason,
            usage,
            matched,
            message,
            logprobs,
            live.weight_version,
            code,
            live.prompt_logprobs(),
            routed,
        )
        live.stream.finish(completion)

    def fail(self, rid: str, error: BaseException) -> None:
        """End a live request's stream with an error (its session turn too); nothing if it
        is not live."""
        live = self.live.pop(rid, None)
        if live is not None:
            if live.session is not None:
                self.sessions.ended(live.session, "", [], "error")
            live.stream.fail(error)

    def fail_all(self, error: BaseException) -> None:
        for live in self.live.values():
            live.stream.fail(error)
        self.live.clear()
