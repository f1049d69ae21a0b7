"""Builds prefill/decode disaggregation's parts for one engine: the KV layout peers write
into, the transfer backend with that KV registered, the transfer actor, and the bootstrap
endpoint's handlers (docs/disaggregation.md)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from shoal.actors.executor.stages import Stage
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import SchedulerMsg
from shoal.actors.supervise import FaultInjector
from shoal.actors.transfer.kv_receive import ReceiveRooms
from shoal.actors.transfer.kv_send import SendRooms
from shoal.actors.transfer.kv_transfer import KVTransfer
from shoal.actors.transfer_messages import PeerArrived, PeerCancel, PeerGone, TransferMsg
from shoal.config import EngineOptions
from shoal.disagg.backend import LocalBackend, LocalFabric, TransferBackend
from shoal.disagg.bootstrap import RoomHandlers
from shoal.disagg.layout import KVLayout
from shoal.disagg.peers import PrefillPeers
from shoal.disagg.wire import RoomRequest, RoomResult


def kv_layout(stages: list[Stage], page_size: int) -> KVLayout:
    """Every layer's K and V, in layer order across the stages' pools."""
    k = [t for stage in stages for t in stage.kv.k]
    v = [t for stage in stages for t in stage.kv.v]
    slot = k[0][0]
    return KVLayout(
        num_layers=len(k),
        num_kv_heads=slot.shape[0],
        head_dim=slot.shape[1],
        page_size=page_size,
        dtype=str(slot.dtype),
        page_bytes=slot.numel() * slot.element_size() * page_size,
        num_pages=k[0].shape[0] // page_size,
        k_addrs=tuple(t.data_ptr() for t in k),
        v_addrs=tuple(t.data_ptr() for t in v),
    )


def advertised_host(host: str) -> str:
    """The address peers reach this machine at: `host`, or for a wildcard this host's."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def transfer_backend(options: EngineOptions, fabric: LocalFabric | None) -> TransferBackend:
    if options.disaggregation_transfer_backend == "local":
        return LocalBackend(fabric if fabric is not None else LocalFabric())
    from shoal.disagg.mooncake import MooncakeBackend  # the optional package, only here

    return MooncakeBackend(advertised_host(options.disaggregation_bootstrap_host))


def build_transfer(
    options: EngineOptions,
    stages: list[Stage],
    page_size: int,
    scheduler: Mailbox[SchedulerMsg],
    weight_version: Callable[[], str],
    weights_digest: Callable[[], str],
    fabric: LocalFabric | None,
    faults: FaultInjector | None,
    peer_key: str | None = None,
) -> tuple[KVTransfer, Mailbox[TransferMsg]]:
    """`weight_version`: the public counter a prefill server reports; `weights_digest`: the
    weights' identity both sides compare (loading/identity.py); `peer_key`: the key
    a decode server's calls to its prefill servers carry."""
    mailbox: Mailbox[TransferMsg] = Mailbox("transfer")
    on_gpu = any(stage.kv.k[0].device.type != "cpu" for stage in stages)
    if on_gpu and options.disaggregation_transfer_backend == "local":
        raise ValueError("disaggregation_transfer_backend local copies host memory only")
    layout = kv_layout(stages, page_size)
    backend = transfer_backend(options, fabric)
    backend.register(layout)
    timeout_s = options.disaggregation_timeout_s
    rooms: SendRooms | ReceiveRooms
    if options.disaggregation_mode == "prefill":
        rooms = SendRooms(
            backend, layout, mailbox, scheduler, timeout_s, weight_version, weights_digest
        )
    else:
        peers = PrefillPeers.parse(options.disaggregation_prefill_peers)
        rooms = ReceiveRooms(
            backend.endpoint, layout, mailbox, scheduler, timeout_s, weights_digest, peers,
            peer_key,
        )  # fmt: skip
    return KVTransfer(rooms, backend, mailbox, scheduler, faults), mailbox


def room_handlers(mailbox: Mailbox[TransferMsg]) -> RoomHandlers:
    """The bootstrap endpoint's calls, as messages to the prefill side's transfer actor."""

    async def register(room: int, request: RoomRequest) -> RoomResult:
        reply: asyncio.Future[RoomResult] = asyncio.get_running_loop().create_future()
        mailbox.put(PeerArrived(room, request, reply))
        return await reply

    async def cancel(room: int, cause: str) -> None:
        reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        mailbox.put(PeerCancel(room, cause, reply))
        await reply

    return RoomHandlers(register, cancel, lambda room: mailbox.put(PeerGone(room)))
