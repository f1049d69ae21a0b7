"""What the reply futures of actors/messages.py carry, and the one way to ask and to answer.

A message that asks for an answer holds `reply: asyncio.Future[T]`, T named on the message.
A reply succeeds with its value or raises; it never answers "why not" as text:

    Snapshot.reply        SchedulerSnapshot        where every request is
    CacheStats.reply      KVStats (cache/stats.py)  the cache's accounting
    UpdateWeights.reply   UpdateResult (results.py) success, why, the version now serving
    OpenSession.reply     None, or raises RequestError (too_many_sessions, a session id in use)
    EndSession.reply      None, or raises RequestError (session_not_found)
    FlushWhenIdle.reply   None, or raises OperationRefused (engine_busy, integrity_violation)
    FlushCache.reply, CheckIntegrity.reply
                          None, or raises OperationRefused (integrity_violation)
    LoadWeights.reply     None, or raises OperationRefused (invalid_checkpoint)
    Park.reply            None once nothing is held and nothing is in flight
    TransferCountsAsk.reply  TransferStats
    Pace's Advance.reply  the launched batch id, or None;  Deliver.reply: the batch id
                          (actors/scheduler/pacing.py; RuntimeError while not held)

Any reply may instead raise InternalError: the actor failed while handling the message
(actors/supervise.py, `fail_replies`).

    snapshot = await ask(box, Snapshot)                       # the message built around a reply
    await ask(executor, partial(LoadWeights, source))         # raises what the reply raises
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec

from shoal.actors.mailbox import Mailbox

T = TypeVar("T")
M = TypeVar("M")


class SchedulerSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Where every request is (docs/architecture.md, "Scheduler"), by request id."""

    waiting: tuple[str, ...]
    prefill: tuple[str, ...]
    running: tuple[str, ...]
    retracting: tuple[str, ...]
    finishing: tuple[str, ...]
    launched_batches: dict[int, tuple[str, ...]]  # batch id -> its members, in batch order
    rows: dict[str, int]  # request id -> its request-slot row, for those holding one
    progress: dict[str, int]  # request id -> positions launched
    plan_pending: bool
    paused: bool
    num_retractions: int
    idle: bool  # law 1: no request anywhere, no batch in flight, no plan outstanding
    held_results: tuple[int, ...] = ()  # test stepping: results waiting for a Deliver
    transfer: tuple[str, ...] = ()  # disaggregation: pages being written (planner_transfers)
    # speculative decoding since start (actors/scheduler/speculation.py): verifications, the
    # drafts they verified, the drafts kept
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    def busy_summary(self) -> str:
        """What keeps the engine from being idle, as "2 running, 1 finishing"."""
        phases = {
            "waiting": self.waiting,
            "prefill": self.prefill,
            "running": self.running,
            "retracting": self.retracting,
            "finishing": self.finishing,
            "transferring KV": self.transfer,
        }
        parts = [f"{len(rids)} {phase}" for phase, rids in phases.items() if rids]
        return ", ".join(parts) or "a batch in flight"


class TransferStats(msgspec.Struct, frozen=True):
    """Disaggregation's rooms in each state (its queues: all 0 when idle), and the KV moved
    since start: transfers done, their bytes, and the seconds they took (prefill side: the
    writes; decode side: from asking for the KV to having it)."""

    rooms: dict[str, int]
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0


def rooms_in_states(states: tuple[str, ...], in_states: Iterable[str]) -> dict[str, int]:
    """How many rooms are in each of `states`, given each room's state (TransferStats.rooms)."""
    out = dict.fromkeys(states, 0)
    for state in in_states:
        out[state] += 1
    return out


def answer(reply: asyncio.Future[T], value: T) -> None:
    """Resolve a reply, unless it is already done (failed by supervision, or cancelled by a
    caller that gave up waiting)."""
    if not reply.done():
        reply.set_result(value)


def refuse(reply: asyncio.Future[T], error: BaseException) -> None:
    """Answer a reply with an error its caller raises."""
    if not reply.done():
        reply.set_exception(error)


def settle(reply: asyncio.Future[None], refusal: BaseException | None) -> None:
    """Answer an operation's reply: done (refusal None), or the refusal its caller raises."""
    if refusal is None:
        answer(reply, None)
    else:
        refuse(reply, refusal)


def unread() -> asyncio.Future[None]:
    """A reply no one waits for (a pause's retraction: the ordered mailboxes already put it
    before anything later); a failure in it is read here, so asyncio does not report it."""
    reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    reply.add_done_callback(lambda done: done.cancelled() or done.exception())
    return reply


async def ask(mailbox: Mailbox[M], message: Callable[[asyncio.Future[T]], M]) -> T:
    """Post `message(reply)` and wait for its reply: its value, or what it raises."""
    reply: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    mailbox.put(message(reply))
    return await reply
