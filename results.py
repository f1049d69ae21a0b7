"""The engine's output vocabulary: what a caller holds for one request (an async stream of
deltas ending in a Completion), its parts (Delta, Usage, TokenLogprob), the closed sets its
seams speak (FinishReason, ErrorCode, RefusalCode), the errors a request can end with, and
what the lifecycle operations answer (UpdateResult, FlushResult, OperationRefused). The core:
the actors produce these and every door hands them out, so it lives outside `api/`
(tests/test_import_directions.py keeps `actors/` from importing `api/`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Literal, get_args

import msgspec

# How a request ended: a stop string or token, its length limit, an abort, or an error. The
# wire says these same strings (OpenAI's finish_reason, /generate's meta_info, the websocket).
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)

# What kind of refusal a RequestError is: the HTTP layer answers each with a status of its own
# (api/http/errors.py, STATUS_OF), never by reading the message. The OpenAI codes for limits
# (limits.py) are among them.
ErrorCode = Literal[
    "invalid_value",  # a field's value breaks its rule
    "invalid_messages",  # the chat template refused the messages
    "context_length_exceeded",  # the prompt, or the prompt plus its output, is too long
    "array_above_max_length",  # a list over its limit (limits.py, TOO_MANY)
    "string_above_max_length",  # a string over its limit (limits.py, TOO_LONG)
    "session_not_found",  # never opened, closed or reaped
    "session_busy",  # the session's last turn still streams
    "too_many_sessions",  # the engine's cap on open sessions is reached
    "peer_refused",  # disaggregation: the other server refused this request as given
    "weights_mismatch",  # disaggregation: the other server serves other weights (a 400:
    # SGLang's router passes a 400 on and never retries it; a 409 it turns into a retried 500)
]
ERROR_CODES: tuple[ErrorCode, ...] = get_args(ErrorCode)


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenLogprob(msgspec.Struct, frozen=True):
    """The raw log-probability of a chosen token, and its most likely alternatives.
    `listed`: the logprobs of the request's token_ids_logprob, in its order; `rank`: the
    token's rank in the distribution, 1 the most likely (prompt positions only; 0: not
    computed)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    listed: tuple[float, ...] = ()
    rank: int = 0


class PromptLogprobs(msgspec.Struct, frozen=True):
    """A prompt's logprobs from position `start` (SGLang's logprob_start_len) to its end:
    `items[i]` is position max(start, 1) + i's token, its logprob given the positions before.
    Position 0 has none (nothing precedes it): when start is 0, `first_token_id` is its token
    and the doors report it with a null logprob."""

    start: int
    first_token_id: int | None
    items: tuple[TokenLogprob, ...]


class Delta(msgspec.Struct, frozen=True):
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when asked for
    prompt_logprobs: PromptLogprobs | None = None  # on a request's first Delta, when asked for


def merged(deltas: list[Delta]) -> Delta:
    """Consecutive Deltas as one, for a reader that fell behind (RequestStream)."""
    text, ids = "".join([d.text for d in deltas]), tuple([t for d in deltas for t in d.token_ids])
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    if all(d.logprobs is None for d in deltas):
        return Delta(text, ids, None, prompt)
    return Delta(text, ids, tuple([lp for d in deltas for lp in d.logprobs or ()]), prompt)


class Completion(msgspec.Struct, frozen=True):
    rid: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    matched_stop: str | int | None = None  # the stop string or stop token that ended it
    message: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None
    weight_version: str = "0"  # the weights its last token came from (see docs/architecture.md)
    code: ErrorCode | None = None  # an "error" that was the caller's mistake, and which
    prompt_logprobs: PromptLogprobs | None = None  # when asked for (logprob_start_len)
    routed_experts: bytes | None = None  # int32 LE [rows, layers, top_k] (return_routed_experts)


class RequestError(ValueError):
    """A request or operation the engine refuses as given: `field` names the culprit (the
    engine's name for it, e.g. "max_new_tokens"; None when no one field is), `code` says what
    kind of refusal it is, `detail` what is wrong. The message is for people; code and field
    are for programs.

    `named`: the message is the field's name followed by the detail ("max_new_tokens" +
    " must be >= 1, got 0"), so a door that calls the field otherwise says it in its own name
    (`spoken`), never by rewriting the text. Otherwise the message is the detail alone.
    """

    def __init__(
        self,
        detail: str,
        field: str | None = None,
        code: ErrorCode = "invalid_value",
        *,
        named: bool = False,
    ) -> None:
        self.named = named and field is not None
        super().__init__(f"{field}{detail}" if self.named else detail)
        self.detail = detail
        self.field = field
        self.code: ErrorCode = code

    def spoken(self, name: str | None) -> str:
        """The message with the field called `name` (a door's name for it)."""
        if not self.named or name is None:
            return str(self)
        return name + self.detail


class InternalError(RuntimeError):
    """A failure inside the engine ended this request or operation; the engine goes on.

    Its message names the part that failed, never the exception: the server log has that."""


class EngineDeadError(RuntimeError):
    """The engine stopped (an actor died or it was shut down) before the request ended."""


# What kind of refusal an OperationRefused is: an operation the engine did not carry out,
# nothing changed. An operation's reply raises it (actors/replies.py); the HTTP lifecycle
# routes answer each operation's refusal with a status of their own (api/http/lifecycle.py).
RefusalCode = Literal[
    "engine_busy",  # a cache flush found the engine busy until its deadline
    "invalid_checkpoint",  # a weight update's checkpoint was refused: the old weights serve
    "integrity_violation",  # the cache's books do not close (a page, row or lock leaked)
]


class OperationRefused(Exception):
    """An operation the engine did not carry out, and why: `code` says what kind of refusal it
    is, the message is for people."""

    def __init__(self, message: str, code: RefusalCode) -> None:
        super().__init__(message)
        self.code: RefusalCode = code


class UpdateResult(msgspec.Struct, frozen=True):
    """A weight update's end (Engine.update_weights_from_disk, POST /update_weights_from_disk):
    whether the checkpoint loaded, what happened (on failure: why; the old weights serve on),
    and the weight version serving now."""

    success: bool
    message: str
    weight_version: str


class FlushResult(msgspec.Struct, frozen=True):
    """A cache flush's end (Engine.flush_cache, POST /flush_cache): whether the prefix cache was
    emptied, and what happened (on failure: why; nothing changed)."""

    success: bool
    message: str


class RequestStream:
    """Async-iterate for Deltas; `await result()` for the Completion.

    Leaving `async with stream:` early, or cancelling the task that iterates it, aborts the
    request. Written to only by the tokenizer actor, on the event loop.

    A reader waiting when a Delta comes gets it (one a token); one that fell behind gets all
    that came since its last read as one Delta (`merged`), never a queue of them.

    `await accepted()` waits until the prompt is encoded and checked (its number of tokens),
    before any Delta: a door that must know of a refusal before it answers (an HTTP stream's
    status line) awaits it, then iterates.
    """

    def __init__(self, rid: str, abort: Callable[[str], None]) -> None:
        self.rid = rid
        self._abort = abort
        # Not yet read: the Deltas since the last read (taken at once), then the end.
        self._pending: list[Delta] = []
        self._end: Completion | BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._completion: Completion | None = None  # the end, once the reader reached it
        self._error: BaseException | None = None  # (or its error)
        self._ended = False
        self._decided = asyncio.Event()  # accepted, or ended first
        self._prompt_tokens: int | None = None  # once accepted
        self._failure: BaseException | None = None  # fail()'s error, for accepted()
        # Told once how the request ended: None when it finished, else why not (an abort, an
        # error) and whether the request was refused as given (a ValueError: the caller's
        # mistake). Disaggregation ends the request's room with it (api/engine.py).
        self.on_end: Callable[[str | None, bool], None] | None = None

    # ---- producer side (tokenizer actor) -------------------------------------------------

    def accept(self, prompt_tokens: int) -> None:
        """The prompt is encoded and checked: the request will be admitted (now, or after a
        weight update it waits for)."""
        if not self._ended and self._prompt_tokens is None:
            self._prompt_tokens = prompt_tokens
            self._decided.set()

    def push(self, delta: Delta) -> None:
        if not self._ended:
            self._pending.append(delta)
            if self._waiters:
                self._wake()

    def finish(self, completion: Completion) -> None:
        if not self._ended:
            self._ended, self._end = True, completion
            self._wake()
            self._decided.set()
            aborted = completion.finish_reason in ("abort", "error")
            cause = (completion.message or "aborted") if aborted else None
            self._tell_end(cause, completion.code is not None)

    def fail(self, error: BaseException) -> None:
        if not self._ended:
            self._ended, self._end = True, error
            self._wake()
            self._failure = error
            self._decided.set()
            self._tell_end(str(error) or type(error).__name__, isinstance(error, ValueError))

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():  # done: cancelled, its reader aborts
                waiter.set_result(None)
        self._waiters.clear()

    def _tell_end(self, cause: str | None, refused: bool) -> None:
        if self.on_end is not None:
            self.on_end(cause, refused)

    @property
    def ended(self) -> bool:
        return self._ended

    # ---- consumer side ---------------------------------------------------------------------

    async def accepted(self) -> int | None:
        """The prompt's number of tokens once it is accepted; None if the request ended
        before (aborted while it waited); raises why it failed before (a refusal of the
        prompt: RequestError). Consumes nothing: iterate afterwards for the Deltas."""
        await self._decided.wait()
        if self._prompt_tokens is None and self._failure is not None:
            raise self._failure
        return self._prompt_tokens

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            if pending := self._pending:
                delta = pending[0] if len(pending) == 1 else merged(pending)
                pending.clear()
                return delta
            if self._completion is not None:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            if isinstance(self._end, Completion):
                self._completion = self._end
            elif self._end is not None:
                self._error = self._end
            else:  # nothing yet: wait for a push or the end
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                except asyncio.CancelledError:  # its waiter, done, is dropped by the next wake
                    self.abort()
                    raise

    async def result(self) -> Completion:
        async for _ in self:
            pass
        assert self._completion is not None
        return self._completion

    def abort(self) -> None:
        if not self._ended:
            self._abort(self.rid)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._completion is None and self._error is None:
            self.abort()
