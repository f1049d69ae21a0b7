"""What the reply futures of actors/messages.py carry, and the one way to answer them.

A message that asks for an answer holds `reply: asyncio.Future[T]`, T named on the message:

    Snapshot.reply        SchedulerSnapshot        where every request is
    CacheStats.reply      KVStats (cache/stats.py)  the cache's accounting
    UpdateWeights.reply   UpdateOutcome            success, why, the version now serving
    OpenSession.reply     None, or raises RequestError (too_many_sessions, a session id in use)
    EndSession.reply      None, or raises RequestError (session_not_found)
    FlushWhenIdle.reply, FlushCache.reply, LoadWeights.reply, CheckIntegrity.reply
                          None when done, else why not (str)
    Park.reply            None once nothing is held and nothing is in flight
    Advance.reply         the launched batch id, or None;  Deliver.reply: the batch id

Any reply may instead raise InternalError: the actor failed while handling the message
(actors/supervise.py, `fail_replies`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import NamedTuple, TypeVar

import msgspec

T = TypeVar("T")


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


class UpdateOutcome(NamedTuple):
    """A weight update's end: whether it loaded, what happened, the version serving now."""

    success: bool
    message: str
    weight_version: int


def answer(reply: asyncio.Future[T], value: T) -> None:
    """Resolve a reply, unless it is already done (failed by supervision, or cancelled by a
    caller that gave up waiting)."""
    if not reply.done():
        reply.set_result(value)


def refuse(reply: asyncio.Future[T], error: BaseException) -> None:
    """Answer a reply with an error its caller raises."""
    if not reply.done():
        reply.set_exception(error)
