"""The KV transfer actor: prefill/decode disaggregation's one owner of every room
(docs/disaggregation.md). A prefill server's rooms are `SendRooms` (actors/transfer/kv_send.py), a
decode server's `ReceiveRooms` (actors/transfer/kv_receive.py); this file is the mailbox and its
`match`.

    scheduler ──ClaimRoom/SendKV/ExpectKV/DropRoom──▶ transfer ──TransferEnded──▶ scheduler
    bootstrap endpoint ──PeerArrived/PeerCancel/PeerGone──▶ transfer     (prefill side)
    its own tasks ──WriteEnded/PollEnded/CancelEnded/RoomDeadline──▶ transfer

Every SendKV and every ExpectKV is answered by exactly one final TransferEnded, sent once
nothing of that room can still write into the request's pages; the planner keeps the pages
until then. On a decode server one `held` TransferEnded may come first: the request ends
then (its caller is answered within the timeout), its pages only at the final one.
"""

from __future__ import annotations

import logging

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import SchedulerMsg, Shutdown
from shoal.actors.replies import answer
from shoal.actors.supervise import FaultInjector, fail_replies, serve
from shoal.actors.transfer.kv_receive import ReceiveRooms
from shoal.actors.transfer.kv_send import SendRooms
from shoal.actors.transfer_messages import (
    CancelEnded,
    ClaimRoom,
    DropRoom,
    ExpectKV,
    PeerArrived,
    PeerCancel,
    PeerGone,
    PollEnded,
    RoomDeadline,
    SendKV,
    TransferCountsAsk,
    TransferMsg,
    WriteEnded,
)
from shoal.disagg.backend import TransferBackend
from shoal.results import InternalError

log = logging.getLogger("shoal.disagg")


class KVTransfer:
    def __init__(
        self,
        rooms: SendRooms | ReceiveRooms,
        backend: TransferBackend,
        mailbox: Mailbox[TransferMsg],
        scheduler: Mailbox[SchedulerMsg],
        faults: FaultInjector | None = None,
    ) -> None:
        self.rooms = rooms
        self.backend = backend
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.faults = faults

    async def run(self) -> None:
        try:
            await serve("transfer", self.mailbox, self.faults, self.handle, self.recover)
        finally:
            if isinstance(self.rooms, ReceiveRooms):
                await self.rooms.shutdown()
            self.backend.close()

    async def handle(self, msg: TransferMsg) -> None:
        send, receive = self._sides()
        match msg:
            case ClaimRoom() if send:
                send.claim(msg)
            case PeerArrived() if send:
                send.arrived(msg)
            case SendKV() if send:
                send.computed(msg)
            case WriteEnded() if send:
                send.write_ended(msg)
            case RoomDeadline() if send:
                send.deadline(msg)
            case PeerCancel(room=room, cause=cause, reply=reply) if send:
                send.stop(room, f"the decode server cancelled: {cause}", reply)
            case PeerGone(room=room) if send:
                send.stop(room, "the decode server disconnected")
            case DropRoom(bootstrap=bootstrap, cause=cause, refused=refused) if send:
                send.stop(bootstrap.room, cause, refused=refused)
            case ExpectKV() if receive:
                receive.expect(msg)
            case PollEnded() if receive:
                receive.polled(msg)
            case CancelEnded() if receive:
                receive.cancelled(msg)
            case DropRoom() if receive:
                receive.drop(msg)
            case TransferCountsAsk(reply=reply):
                answer(reply, self.rooms.stats())
            case Shutdown():
                if send:
                    await send.shutdown()
            case _:
                raise AssertionError(f"{type(msg).__name__} on the wrong side of a transfer")

    def _sides(self) -> tuple[SendRooms | None, ReceiveRooms | None]:
        if isinstance(self.rooms, SendRooms):
            return self.rooms, None
        return None, self.rooms

    def recover(self, msg: TransferMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py): the room it stood for ends with the
        error, on both servers, and its request's pages are freed only once no write can
        still land (a running write's end, the prefill server's confirmation)."""
        fail_replies(msg, error)
        send, receive = self._sides()
        cause = str(error)
        match msg:
            case ClaimRoom(rid=rid, room=room) | SendKV(rid=rid, room=room) if send:
                send.fail(room, cause, rid)
            case (
                PeerArrived(room=room)
                | PeerCancel(room=room)
                | PeerGone(room=room)
                | WriteEnded(room=room)
                | RoomDeadline(room=room)
            ) if send:
                send.fail(room, cause)
            case DropRoom(bootstrap=bootstrap) if send:
                send.fail(bootstrap.room, cause)
            case ExpectKV(rid=rid, bootstrap=bootstrap) if receive:
                receive.fail(bootstrap.room, cause, rid)
            case PollEnded(room=room) | CancelEnded(room=room) if receive:
                receive.fail(room, cause)
            case DropRoom(rid=rid, bootstrap=bootstrap) if receive:
                receive.fail(bootstrap.room, cause)
