"""Disaggregation's rooms as the Engine sees them (docs/disaggregation.md): which prefill
servers a decode server may contact, a room's end when its request ends badly or a door
refuses it, and the transfer actor's counts.

    rooms.check_peer(bootstrap)                  # RequestError: not a listed prefill server
    stream.on_end = partial(rooms.end, rid, bootstrap)
    rooms.drop(bootstrap, cause)                 # a door refused the request before the engine
    stats = await rooms.stats()                  # TransferStats ({} rooms without disaggregation)
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.actors.replies import TransferStats, ask
from shoal.actors.transfer_messages import DropRoom, TransferCountsAsk
from shoal.actors.wiring import Actors
from shoal.config import EngineOptions
from shoal.disagg.peers import PrefillPeers
from shoal.params import Bootstrap
from shoal.results import RequestError


class Rooms:
    def __init__(
        self,
        options: EngineOptions,
        started: Callable[[], Actors | None],
        actors: Callable[[], Actors],
    ) -> None:
        """`started`: the actors once started (None before: a room's end is nobody's to
        tell); `actors`: the actors, raising if the engine cannot answer (Engine.actors)."""
        self.mode = options.disaggregation_mode
        self.prefill_peers = PrefillPeers.parse(options.disaggregation_prefill_peers)
        self._started = started
        self._actors = actors

    def check_peer(self, bootstrap: Bootstrap | None) -> None:
        """A decode server contacts only the prefill servers of its own configuration
        (disaggregation_prefill_peers), never one a client names: RequestError naming the
        field, before anything is reserved."""
        if bootstrap is None or self.mode != "decode":
            return
        refusal = self.prefill_peers.refusal(bootstrap.host, bootstrap.port)
        if refusal is not None:
            field, why = refusal
            raise RequestError(why, field)

    def end(self, rid: str, bootstrap: Bootstrap, cause: str | None, refused: bool) -> None:
        """A disaggregated request ended (RequestStream.on_end): if not well, its room ends on
        both servers with the cause, wherever the request was (even refused before it was
        admitted)."""
        actors = self._started()
        if cause is not None and actors is not None and actors.transfer_box is not None:
            actors.transfer_box.put(DropRoom(rid, bootstrap, cause, refused))

    def drop(self, bootstrap: Bootstrap, cause: str, refused: bool = True) -> None:
        """A door refused a disaggregated request before it reached the engine (a bad field):
        end its room on both servers with the cause (a decode server tells only a listed
        prefill server)."""
        try:
            self.check_peer(bootstrap)
        except RequestError:
            return
        self.end("", bootstrap, cause, refused)

    async def stats(self) -> TransferStats:
        """Disaggregation's rooms in each state and the KV moved (actors/replies.py)."""
        box = self._actors().transfer_box
        if box is None:
            return TransferStats({})
        return await ask(box, TransferCountsAsk)
