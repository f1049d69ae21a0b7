"""The prefill side's rooms: one state machine per room, owned by the transfer actor.

A room needs two halves, the local request (ClaimRoom, then SendKV once its KV is computed)
and the decode server's pages (PeerArrived, from the bootstrap endpoint), in either order.
Both halves present, the room is written only if they agree: the same prompt, KV layout and
weights (the decode server's weights digest is this server's: loading/identity.py;
otherwise both requests end with code "weights_mismatch", a 400, before anything is written)::

    bootstrap ──both halves──▶ prefilling ──SendKV──▶ transferring ──WriteEnded──▶ done
        │                          │                       │
        └──── a deadline, DropRoom, PeerCancel, PeerGone, a mismatch ──────────▶ failed

Which queue a room is in is its state (`SendRoom.state`), never a second list. A room ends
in one place (`SendRooms.end`): the decode server's wait is answered, the local request
gets TransferEnded, and the cause is kept (`ended`) so that a half arriving later hears it
at once instead of waiting for a deadline. While a write runs nothing ends the room: a cause
found meanwhile is kept and reported when the write returns, because only then can no byte
of it still land in the decode server's pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import SchedulerMsg, TransferEnded
from shoal.actors.replies import TransferStats, answer, rooms_in_states
from shoal.actors.transfer_messages import (
    ClaimRoom,
    PeerArrived,
    RoomDeadline,
    SendKV,
    TransferMsg,
    WriteEnded,
)
from shoal.disagg.backend import TransferBackend
from shoal.disagg.layout import KVLayout, page_copies
from shoal.disagg.wire import RoomRequest, RoomResult
from shoal.results import ErrorCode

MAX_ENDED = 4096  # causes kept for rooms that ended, oldest forgotten first
SHUTDOWN_WRITE_WAIT_S = 60.0
log = logging.getLogger("shoal.disagg")


@dataclass
class SendRoom:
    room: int
    rid: str | None = None
    digest: str | None = None
    peer: RoomRequest | None = None
    reply: asyncio.Future[RoomResult] | None = None
    kv: SendKV | None = None
    writing: bool = False
    write: asyncio.Task[None] | None = None
    cause: str | None = None  # why it fails, found while a write ran
    cancels: list[asyncio.Future[None]] = field(default_factory=list)
    serial: int = 0

    @property
    def state(self) -> str:
        if self.writing:
            return "transferring"
        return "bootstrap" if self.peer is None or self.rid is None else "prefilling"


class SendRooms:
    STATES = ("bootstrap", "prefilling", "transferring")

    def __init__(
        self,
        backend: TransferBackend,
        layout: KVLayout,
        mailbox: Mailbox[TransferMsg],
        scheduler: Mailbox[SchedulerMsg],
        timeout_s: float,
        weight_version: Callable[[], str],
        weights_digest: Callable[[], str],
    ) -> None:
        self.backend = backend
        self.layout = layout
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.weight_version = weight_version
        self.weights_digest = weights_digest
        self.rooms: dict[int, SendRoom] = {}
        self.ended: OrderedDict[int, tuple[str, bool]] = OrderedDict()  # (cause, refused)
        self.num_writes, self.num_bytes, self.write_s = 0, 0, 0.0  # done so far

    def stats(self) -> TransferStats:
        rooms = rooms_in_states(self.STATES, (room.state for room in self.rooms.values()))
        return TransferStats(rooms, self.num_writes, self.num_bytes, self.write_s)

    # ---- the two halves --------------------------------------------------------------------

    def claim(self, msg: ClaimRoom) -> None:
        if msg.room in self.ended:
            cause, _ = self.ended[msg.room]
            self.scheduler.put(TransferEnded(msg.rid, msg.room, cause))
            return
        room = self._room(msg.room)
        if room.rid is not None:
            cause = f"room {msg.room} is already in use by another request"
            self.scheduler.put(TransferEnded(msg.rid, msg.room, cause))
            return
        room.rid, room.digest = msg.rid, msg.prompt_digest
        self._check(room)

    def arrived(self, msg: PeerArrived) -> None:
        if msg.room in self.ended:
            cause, refused = self.ended[msg.room]
            answer(msg.reply, self._failed(cause, refused))
            return
        room = self._room(msg.room)
        if room.peer is not None:
            answer(msg.reply, self._failed(f"room {msg.room} already has a decode server"))
            return
        room.peer, room.reply = msg.request, msg.reply
        self._check(room)

    def computed(self, msg: SendKV) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.rid != msg.rid:
            cause, _ = self.ended.get(msg.room, (f"room {msg.room} ended", False))
            self.scheduler.put(TransferEnded(msg.rid, msg.room, cause))
            return
        room.kv = msg
        self._check(room)

    def _room(self, number: int) -> SendRoom:
        room = self.rooms.get(number)
        if room is None:
            room = self.rooms[number] = SendRoom(number)
            self._arm(room)
        return room

    def _arm(self, room: SendRoom) -> None:
        room.serial += 1
        loop = asyncio.get_running_loop()
        loop.call_later(self.timeout_s, self.mailbox.put, RoomDeadline(room.room, room.serial))

    def _check(self, room: SendRoom) -> None:
        """Both halves known: do they agree? With the KV computed too: write it."""
        peer = room.peer
        if peer is None or room.rid is None:
            return
        mine = self.weights_digest()
        if peer.weights_digest != mine:
            cause = (
                f"the two servers serve different weights (weights digest {mine} on the "
                f"prefill server, {peer.weights_digest[:40] or 'none'} on the decode server)"
            )
            self.end(room, cause, code="weights_mismatch")
        elif peer.prompt_digest != room.digest:
            self.end(room, "the decode server holds a different prompt for this room")
        elif (mismatch := self.layout.mismatch(peer.layout)) is not None:
            self.end(room, mismatch)
        elif room.kv is not None:
            self._write(room, room.kv, peer)

    def _write(self, room: SendRoom, kv: SendKV, peer: RoomRequest) -> None:
        page_size = self.layout.page_size
        skip = peer.skip_tokens // page_size
        src_pages = list(kv.pages[skip:])
        if kv.num_tokens != peer.num_tokens or len(src_pages) != len(peer.pages):
            self.end(room, "the decode server's pages do not cover this prompt")
            return
        srcs, dsts, lengths = page_copies(self.layout, src_pages, peer.layout, list(peer.pages))
        room.writing = True
        task = asyncio.create_task(self._run_write(room.room, peer.endpoint, srcs, dsts, lengths))
        room.write = task

    async def _run_write(
        self, number: int, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]
    ) -> None:
        began = time.perf_counter()
        try:
            error = await asyncio.to_thread(self.backend.write, peer, srcs, dsts, lengths)
        except Exception as exc:  # a backend's own failure is this room's, not the actor's
            error = f"the transfer backend failed: {exc!r}"
        if error is None:
            self.num_writes += 1
            self.num_bytes += sum(lengths)
            self.write_s += time.perf_counter() - began
        self.mailbox.put(WriteEnded(number, error))

    # ---- endings ---------------------------------------------------------------------------

    def write_ended(self, msg: WriteEnded) -> None:
        room = self.rooms[msg.room]
        room.writing = False
        cause = msg.error or room.cause
        if cause is not None:
            self.end(room, cause)
            return
        kv = room.kv
        assert kv is not None and room.rid is not None
        del self.rooms[room.room]
        if room.reply is not None:
            result = RoomResult(
                True,
                first_token=kv.first_token,
                logprob=kv.logprob,
                weight_version=self.weight_version(),
                weights_digest=self.weights_digest(),
            )
            answer(room.reply, result)
        self.scheduler.put(TransferEnded(room.rid, room.room, None))
        for cancel in room.cancels:
            answer(cancel, None)

    def stop(
        self,
        number: int,
        cause: str,
        reply: asyncio.Future[None] | None = None,
        refused: bool = False,
    ) -> None:
        """End a room from outside (DropRoom, PeerCancel, PeerGone): at once, or when its
        write returns. A room not seen yet is remembered as ended. `refused`: this server
        refused the request as given, which the decode server passes on to its caller."""
        room = self.rooms.get(number)
        if room is None:
            self._remember(number, cause, refused)
            if reply is not None:
                answer(reply, None)
            return
        if room.writing:
            room.cause = room.cause or cause
            if reply is not None:
                room.cancels.append(reply)
            return
        self.end(room, cause, refused)
        if reply is not None:
            answer(reply, None)

    def fail(self, number: int, cause: str, rid: str | None = None) -> None:
        """Supervision (actors/transfer/kv_transfer.py): whatever a failed message left half done,
        the room ends with the cause (after its write, if one runs), and `rid`, when it
        waits for a TransferEnded the room cannot send, gets one."""
        room = self.rooms.get(number)
        if room is not None and room.writing and room.write is not None and room.write.done():
            room.writing = False  # its write's end was the message that failed
        if (room is None or room.rid != rid) and rid is not None:
            self.scheduler.put(TransferEnded(rid, number, cause))
        self.stop(number, cause)

    def deadline(self, msg: RoomDeadline) -> None:
        """A room still missing a half after timeout_s fails (once both are here, the decode
        server's own timeout bounds the wait: it cancels the room)."""
        room = self.rooms.get(msg.room)
        if room is None or room.serial != msg.serial or room.state != "bootstrap":
            return
        missing = "decode server" if room.peer is None else "prefill request"
        self.end(room, f"no {missing} arrived for room {room.room} within {self.timeout_s:g}s")

    def end(
        self, room: SendRoom, cause: str, refused: bool = False, code: ErrorCode | None = None
    ) -> None:
        """The one place a room fails: both halves hear the cause (`code`: its kind, for the
        local request's caller)."""
        assert not room.writing
        del self.rooms[room.room]
        self._remember(room.room, cause, refused)
        if room.reply is not None:
            answer(room.reply, self._failed(cause, refused))
        if room.rid is not None:
            self.scheduler.put(TransferEnded(room.rid, room.room, cause, code=code))
        for cancel in room.cancels:
            answer(cancel, None)

    def _failed(self, cause: str, refused: bool = False) -> RoomResult:
        """A failed room's answer; it names this server's weights, so that a decode server
        serving other ones knows why (a 400, not a 5xx)."""
        return RoomResult(False, cause, refused, weights_digest=self.weights_digest())

    def _remember(self, number: int, cause: str, refused: bool = False) -> None:
        self.ended[number] = (cause, refused)
        self.ended.move_to_end(number)
        while len(self.ended) > MAX_ENDED:
            self.ended.popitem(last=False)

    async def shutdown(self) -> None:
        """End every room. Writes still running are waited for first (a backend bounds each:
        Mooncake's MC_TRANSFER_TIMEOUT), so the decode server hears of the end only once
        nothing can land in its pages, even when this engine closes inside a process that
        lives on."""
        writes = [room.write for room in self.rooms.values() if room.writing and room.write]
        if writes:
            _, late = await asyncio.wait(writes, timeout=SHUTDOWN_WRITE_WAIT_S)
            if late:
                log.error(
                    "%d KV writes still ran after %ss at shutdown", len(late), SHUTDOWN_WRITE_WAIT_S
                )
        for room in list(self.rooms.values()):
            room.writing = False
            self.end(room, "the prefill server is shutting down")
