"""The decode side's rooms: one state machine per room, owned by the transfer actor.

    waiting ──the prefill server answers──▶ done (TransferEnded with its first token)
       │                                  ▶ failed (its cause)
       ├── unreachable and surely stopped (refused, reset) ──▶ failed
       └── DropRoom, or a timeout ──▶ cancelling ──the prefill server confirms, or is
                                         ▲          surely stopped──▶ failed
                                         └── not confirmed: asked again every second

The request's pages are reserved (the planner holds them) from ExpectKV until TransferEnded,
and TransferEnded is sent only once no write of the room can still land in them: the prefill
server answers a room only after its write returned, confirms a cancel only after that, and
a peer whose connection was refused or reset has stopped. A peer that is alive but silent
keeps the pages (state "cancelling") until it answers: better held than overwritten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Bootstrap, SchedulerMsg, TransferEnded
from shoal.actors.replies import TransferStats, rooms_in_states
from shoal.actors.transfer_messages import CancelEnded, DropRoom, ExpectKV, PollEnded, TransferMsg
from shoal.disagg.bootstrap import Unreachable, ask_room, cancel_room
from shoal.disagg.layout import KVLayout
from shoal.disagg.wire import RoomRequest

CANCEL_RETRY_S = 1.0


@dataclass
class ReceiveRoom:
    rid: str
    bootstrap: Bootstrap
    state: str = "waiting"  # or "cancelling"
    cause: str = ""
    num_bytes: int = 0
    asked_at: float = 0.0


def base_url(bootstrap: Bootstrap) -> str:
    host = f"[{bootstrap.host}]" if ":" in bootstrap.host else bootstrap.host
    return f"http://{host}:{bootstrap.port}"


class ReceiveRooms:
    STATES = ("waiting", "cancelling")

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        mailbox: Mailbox[TransferMsg],
        scheduler: Mailbox[SchedulerMsg],
        timeout_s: float,
        weight_version: Callable[[], int],
    ) -> None:
        self.endpoint = endpoint
        self.layout = layout
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.weight_version = weight_version
        self.rooms: dict[int, ReceiveRoom] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None
        self.num_transfers, self.num_bytes, self.transfer_s = 0, 0, 0.0  # received so far

    def stats(self) -> TransferStats:
        rooms = rooms_in_states(self.STATES, (room.state for room in self.rooms.values()))
        return TransferStats(rooms, self.num_transfers, self.num_bytes, self.transfer_s)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:  # no cap on connections: each waiting room holds one
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self.session

    # ---- events ----------------------------------------------------------------------------

    def expect(self, msg: ExpectKV) -> None:
        number = msg.bootstrap.room
        if number in self.rooms:
            cause = f"room {number} is already in use by another request"
            self.scheduler.put(TransferEnded(msg.rid, number, cause))
            return
        request = RoomRequest(
            self.endpoint, self.layout, msg.pages, msg.skip_tokens, msg.num_tokens,
            msg.prompt_digest,
        )  # fmt: skip
        room = self.rooms[number] = ReceiveRoom(msg.rid, msg.bootstrap)
        room.num_bytes = 2 * self.layout.num_layers * self.layout.page_bytes * len(msg.pages)
        room.asked_at = time.perf_counter()
        self._spawn(self._poll(number, base_url(msg.bootstrap), request))

    async def _poll(self, number: int, url: str, request: RoomRequest) -> None:
        outcome = await ask_room(self._session(), url, number, request, self.timeout_s)
        if isinstance(outcome, Unreachable):
            self.mailbox.put(PollEnded(number, None, outcome.why, outcome.stopped))
        else:
            self.mailbox.put(PollEnded(number, outcome))

    def polled(self, msg: PollEnded) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.state != "waiting":
            return  # cancelling: the cancel's answer ends it
        result = msg.result
        if result is None:
            if msg.stopped:
                self._end(msg.room, msg.why)
            else:
                self._cancel(room, msg.room, msg.why)
            return
        if not result.ok:
            self._end(msg.room, f"the prefill server: {result.error}", result.refused)
            return
        version = self.weight_version()
        if result.weight_version != version:
            cause = (
                f"the prefill server computed this KV under weight_version "
                f"{result.weight_version}; this server serves {version}"
            )
            self._end(msg.room, cause)
            return
        del self.rooms[msg.room]
        self.num_transfers += 1
        self.num_bytes += room.num_bytes
        self.transfer_s += time.perf_counter() - room.asked_at
        self.scheduler.put(
            TransferEnded(room.rid, msg.room, None, result.first_token, result.logprob)
        )

    def drop(self, msg: DropRoom) -> None:
        room = self.rooms.get(msg.bootstrap.room)
        if room is None or room.rid != msg.rid:
            # Never asked: tell the prefill server so its half ends now, not at a deadline.
            url = base_url(msg.bootstrap)
            self._spawn(cancel_room(self._session(), url, msg.bootstrap.room, msg.cause, 5.0))
            return
        if room.state == "waiting":
            self._cancel(room, msg.bootstrap.room, msg.cause)

    def _cancel(self, room: ReceiveRoom, number: int, cause: str) -> None:
        # The wait, if still open, is left to end by itself: the prefill server answers it
        # with this cause once the cancel lands (closing it would say only "gone").
        room.state, room.cause = "cancelling", cause
        self._spawn(self._send_cancel(number, base_url(room.bootstrap), cause, delay_s=0.0))

    async def _send_cancel(self, number: int, url: str, cause: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        outcome = await cancel_room(self._session(), url, number, cause, self.timeout_s)
        if outcome is None or outcome.stopped:
            self.mailbox.put(CancelEnded(number, True))
        else:
            self.mailbox.put(CancelEnded(number, False, outcome.why))

    def cancelled(self, msg: CancelEnded) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            return
        if msg.confirmed:
            self._end(msg.room, room.cause)
        else:  # alive but silent: the pages stay reserved until it confirms
            url = base_url(room.bootstrap)
            self._spawn(self._send_cancel(msg.room, url, room.cause, delay_s=CANCEL_RETRY_S))

    def fail(self, number: int, cause: str, rid: str | None = None) -> None:
        """Supervision (actors/kv_transfer.py): a waiting room is cancelled (its pages free
        once the prefill server confirms); a cancelling one asks again; `rid`, when it
        waits for a TransferEnded no room will send, gets one."""
        room = self.rooms.get(number)
        if room is None or (rid is not None and room.rid != rid):
            if rid is not None:
                self.scheduler.put(TransferEnded(rid, number, cause))
            return
        if room.state == "waiting":
            self._cancel(room, number, cause)
        else:
            self.cancelled(CancelEnded(number, False, cause))

    def _end(self, number: int, cause: str, refused: bool = False) -> None:
        room = self.rooms.pop(number)
        self.scheduler.put(TransferEnded(room.rid, number, cause, refused=refused))

    async def shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
