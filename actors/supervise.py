"""Per-message supervision: one message's failure fails that message's work, not the actor.

Every actor runs as::

    await serve("scheduler", mailbox, faults, self.handle, self.recover)

`handle(msg)` is called for each message in order, Shutdown included (after which `serve`
returns). An exception while one message is handled is logged with its detail, and the
actor's `recover(msg, error)` fails whatever that message stood for: a request's stream ends
with an error, an operation's reply says it failed. The actor then takes its next message.

Only a failure that leaves shared state unknown stops the engine: a recovery raises `Fatal`
(the scheduler and the cache manager could disagree about who holds a page; an integrity
violation), or a recovery itself fails. The actor's task then ends with that error, and the
wiring (actors/wiring.py) ends every open stream and reports the engine dead.

What reaches a caller is an `InternalError` naming the actor and the message kind, never the
exception's text: the log keeps the detail.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Shutdown
from shoal.results import InternalError

log = logging.getLogger("shoal.supervise")

M = TypeVar("M")


class Fatal(Exception):
    """A failure after which shared state is unknown: the engine must stop."""


class InjectedFault(Exception):
    """Raised by FaultInjector in place of a real bug (tests only)."""


class FaultInjector:
    """A test seam: make an actor's handling of the next message of a kind raise.

        engine.testing.faults.arm("scheduler", "Admit")   # the scheduler's next Admit fails

    Unarmed, it costs one truth test per message.
    """

    def __init__(self) -> None:
        self.armed: dict[tuple[str, str], int] = {}
        self.fired: list[tuple[str, str]] = []

    def arm(self, actor: str, message: str, times: int = 1) -> None:
        self.armed[(actor, message)] = times

    def check(self, actor: str, msg: object) -> None:
        if not self.armed:
            return
        key = (actor, type(msg).__name__)
        left = self.armed.get(key, 0)
        if left <= 0:
            return
        if left == 1:
            del self.armed[key]
        else:
            self.armed[key] = left - 1
        self.fired.append(key)
        raise InjectedFault(f"fault injected into the {actor} handling {key[1]}")


async def serve(
    actor: str,
    mailbox: Mailbox[M],
    faults: FaultInjector | None,
    handle: Callable[[M], Awaitable[None]],
    recover: Callable[[M, InternalError], None],
) -> None:
    """Handle every message until Shutdown; recover from each one's failure (see module)."""
    while True:
        msg = await mailbox.get()
        try:
            if faults is not None and not isinstance(msg, Shutdown):
                faults.check(actor, msg)
            await handle(msg)
        except Exception as exc:
            kind = type(msg).__name__
            log.error("the %s failed while handling %s", actor, kind, exc_info=exc)
            recover(msg, InternalError(f"internal error in the {actor} while handling {kind}"))
        if isinstance(msg, Shutdown):
            return


def fail_replies(msg: object, error: BaseException) -> None:
    """What every recovery does first (and the engine's end, with EngineDeadError): a reply
    future gets the error; a request's stream ends with it."""
    reply = getattr(msg, "reply", None)
    if isinstance(reply, asyncio.Future) and not reply.done():
        reply.set_exception(error)
    stream = getattr(msg, "stream", None)
    fail = getattr(stream, "fail", None)
    if callable(fail):
        fail(error)
