"""The tokenizer actor's way in (docs/architecture.md, "Tokenizer: the front desk"): every
prompt is measured here, off the event loop, and every message that must keep its order waits
in one line.

    entry = intake.arrive(msg)          # an ordered message joins the line
    done = intake.measure(entry)        # a request's prompt: input_ids at once (done), text and
                                        # messages on the worker (Encoded comes back)
    intake.measure_turn(entry, history) # a session turn's, once it is at the front
    entry = intake.front()              # the first in line; the tokenizer lets it through
    entry = intake.withdraw(rid)        # an Abort: the request leaves, wherever it waits
    admit = intake.admission(gen, prompt, session)   # the scheduler's Admit, seeded

The worker is one thread, the actor's own. A fast tokenizer's encode releases the GIL, a chat
template (jinja2) holds it in short slices; either way the event loop keeps delivering every
other request's tokens meanwhile. What the worker runs is pure (encode.py, chat_turns.py), and
its result comes back as an `Encoded` message, so the actor's state changes only in its own
handler.

The line's invariant: the Engine's messages take effect in the order they arrived. An ordered
message (a request, and every Engine message but Abort: the controls, a weight update, a pause,
a session's open and end) waits behind a request still being measured, so an Advance never
overtakes the Generate it follows, a pause or a weight update finds the requests sent before it
admitted (readers of the update lock), a session's close finds its turn started. The messages
of the scheduler and the actor's own (Outputs, Released, WriteDone, Encoded), and Abort, take
effect at once: every stream keeps flowing while a long prompt is measured, and a client that
leaves does not wait for its own prompt.

A request in the line is somewhere (law 1): an Abort takes it out and ends its stream (nothing
of it was computed), the engine's stop fails it, no writer starts ahead of it (a weight update
waits in line behind it), and neither does a Snapshot, so the engine is never seen idle while
a prompt is measured. A request that waits aside, behind a writer (UpdateLock) or behind its
session's last turn (SessionBook), goes back to the front of the line when its wait ends:
whatever is still in line arrived after it.

A stateless request's prompt is measured as soon as it arrives, and its stream is told
(RequestStream.accept) or fails then, wherever it waits; it is admitted in its turn. A session
turn's prompt is measured at the front, from its session as it is then (chat_turns.py).

A request with a grammar (json_schema, regex, ebnf, structural_tag) has it compiled first, on
the compile threads (COMPILE_THREADS; kernels/grammars.py: cached, the GIL released), then
measured as any other: a grammar that does not compile, or takes longer than the engine's
compile timeout, fails the request with a RequestError naming its field, and nothing of it is
queued. A compile that runs on past its timeout keeps its thread (xgrammar cannot be stopped)
until it ends, and caches its grammar; the other threads compile the grammars behind it, and
every request is measured meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from shoal.actors.messages import Admit, Encoded, Generate, TokenizerMsg
from shoal.actors.tokenizer.chat_turns import History, measure_turn
from shoal.actors.tokenizer.encode import Prompt, measure
from shoal.actors.tokenizer.sessions import SessionState
from shoal.kernels.grammars import Grammars
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.params import GrammarSpec
from shoal.results import RequestError

# Grammars compiled at once: one runaway compile (past its timeout) leaves the rest of them
COMPILE_THREADS = 4


@dataclass(eq=False)
class Waiting:
    """One ordered message in the line (or a request aside, behind a writer)."""

    msg: TokenizerMsg
    ticket: int
    prompt: Prompt | None = None  # a request's, measured and checked
    measuring: asyncio.Future[Prompt] | None = None  # on the worker
    session: SessionState | None = None  # a turn's session, reserved for it while measured
    cleared: bool = False  # the update lock let it through (or it waited for a writer)
    aside: bool = False  # waits for a writer: the lock holds its Generate


class Intake:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        vocab_size: int,
        context_length: int,
        seed: int | None,
        post: Callable[[Encoded], None],
        grammars: Grammars | None = None,
        compile_timeout_s: float = 10.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.compile_timeout_s = compile_timeout_s
        self.compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="shoal-grammar")
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.post = post  # into the actor's own mailbox
        self.rng = random.Random(seed)  # the seeds of unseeded requests, reproducible
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="shoal-tokenize")
        self.tickets = itertools.count()
        self.line: deque[Waiting] = deque()
        self.aside: dict[int, Waiting] = {}  # by ticket

    # ---- the line ------------------------------------------------------------------------

    def arrive(self, msg: TokenizerMsg) -> Waiting:
        entry = Waiting(msg, next(self.tickets))
        self.line.append(entry)
        return entry

    def front(self) -> Waiting | None:
        return self.line[0] if self.line else None

    def pop(self) -> Waiting:
        return self.line.popleft()

    def to_front(self, gens: Iterable[Generate]) -> None:
        """Requests whose wait aside ended (a writer's, their session's last turn), in their
        order, ahead of everything still in line; the lock has let them through."""
        entries = []
        for gen in gens:
            entry = self._take_aside(gen) or Waiting(gen, next(self.tickets))
            entry.cleared, entry.aside = True, False
            entries.append(entry)
        self.line.extendleft(reversed(entries))

    def set_aside(self, entry: Waiting) -> None:
        """The front request waits for a writer (the lock queued its Generate)."""
        assert self.line[0] is entry
        self.line.popleft()
        entry.aside = True
        self.aside[entry.ticket] = entry

    def _take_aside(self, gen: Generate) -> Waiting | None:
        for ticket, entry in self.aside.items():
            if isinstance(entry.msg, Generate) and entry.msg.stream is gen.stream:
                return self.aside.pop(ticket)
        return None

    def find(self, ticket: int) -> Waiting | None:
        """The request a measuring stands for, if it still waits (in line or aside)."""
        entry = self.aside.get(ticket)
        if entry is None:
            entry = next((e for e in self.line if e.ticket == ticket), None)
        return entry

    def withdraw(self, rid: str) -> Waiting | None:
        """Take the request with this id out of the line or from aside (the first found);
        its measuring, if not begun, never runs."""
        return self._remove(lambda gen: gen.rid == rid)

    def take(self, gen: Generate) -> Waiting | None:
        """Take this very request out, if it waits."""
        return self._remove(lambda waiting: waiting.stream is gen.stream)

    def remove(self, entry: Waiting) -> None:
        if entry.aside:
            del self.aside[entry.ticket]
        else:
            self.line.remove(entry)
        if entry.measuring is not None:
            entry.measuring.cancel()

    def _remove(self, match: Callable[[Generate], bool]) -> Waiting | None:
        for entry in self.waiting():
            if isinstance(entry.msg, Generate) and match(entry.msg):
                self.remove(entry)
                return entry
        return None

    def waiting(self) -> Iterator[Waiting]:
        yield from list(self.line)
        yield from list(self.aside.values())

    def abandon(self) -> list[Waiting]:
        """The engine stops: everything in line and aside, for the owner to fail."""
        out = list(self.waiting())
        self.line.clear()
        self.aside.clear()
        self.close()
        return out

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
        self.compiler.shutdown(wait=False, cancel_futures=True)

    # ---- measuring ------------------------------------------------------------------------

    def measure(self, entry: Waiting) -> Encoded | None:
        """Start measuring a stateless request's prompt: input_ids at once (counted and
        compared, nothing to encode: the result), text and messages on the worker (None: its
        Encoded comes back)."""
        gen = entry.msg
        assert isinstance(gen, Generate)
        work = partial(measure, self.tokenizer, gen, self.vocab_size, self.context_length)
        if gen.input_ids is None or gen.sampling.grammar is not None:
            self._start(entry, work, gen.sampling.grammar)
            return None
        try:
            return Encoded(entry.ticket, work(), None)
        except Exception as exc:
            return Encoded(entry.ticket, None, exc)

    def measure_turn(self, entry: Waiting, history: History) -> None:
        """Start measuring a session turn's prompt against its session's history, on the
        worker (its Encoded comes back)."""
        gen = entry.msg
        assert isinstance(gen, Generate)
        vocab, context = self.vocab_size, self.context_length
        work = partial(measure_turn, self.tokenizer, history, gen, vocab, context)
        self._start(entry, work, gen.sampling.grammar)

    def _start(
        self, entry: Waiting, work: Callable[[], Prompt], grammar: GrammarSpec | None = None
    ) -> None:
        measuring: asyncio.Future[Prompt]
        if grammar is None:
            measuring = asyncio.get_running_loop().run_in_executor(self.worker, work)
        else:
            measuring = asyncio.ensure_future(self._compile_then(grammar, work))
        entry.measuring = measuring
        measuring.add_done_callback(partial(self._measured, entry.ticket))

    async def _compile_then(self, grammar: GrammarSpec, work: Callable[[], Prompt]) -> Prompt:
        """The request's grammar compiled (RequestError naming its field if it does not, or
        not within the timeout), then its prompt measured."""
        if self.grammars is None:
            raise RequestError(" is not available on this engine", grammar.kind, named=True)
        loop = asyncio.get_running_loop()
        if not self.grammars.is_ready:  # once: not timed
            await loop.run_in_executor(self.compiler, self.grammars.ready)
        compiling = loop.run_in_executor(self.compiler, self.grammars.compile, grammar)
        try:
            await asyncio.wait_for(compiling, self.compile_timeout_s)
        except TimeoutError:
            why = (
                f" took longer than {self.compile_timeout_s:g} s to compile "
                "(grammar_compile_timeout_s); simplify it"
            )
            raise RequestError(why, grammar.kind, named=True) from None
        return await loop.run_in_executor(self.worker, work)

    def _measured(self, ticket: int, measuring: asyncio.Future[Prompt]) -> None:
        if measuring.cancelled():  # withdrawn before it ran
            return
        error = measuring.exception()
        if error is None:
            self.post(Encoded(ticket, measuring.result(), None))
        else:
            failure = error if isinstance(error, Exception) else RuntimeError(repr(error))
            self.post(Encoded(ticket, None, failure))

    # ---- admission -------------------------------------------------------------------------

    def admission(self, gen: Generate, prompt: Prompt, session: SessionState | None) -> Admit:
        """The scheduler's Admit for a measured prompt, with its seed."""
        sampling = prompt.sampling
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        ids = tuple(prompt.ids)
        if session is None:
            return Admit(gen.rid, ids, sampling, seed, bootstrap=gen.bootstrap)
        return Admit(gen.rid, ids, sampling, seed, session.session_id, len(session.tokens))
