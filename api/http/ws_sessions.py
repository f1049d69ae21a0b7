"""GET /v1/sessions/ws: a streaming session over a websocket (messages in ws_protocol).

One connection holds at most one session and at most one live turn:

    no session ──open──▶ open ──turn──▶ turn live ──done sent──▶ open ──close──▶ no session
                                          │ cancel: its done says "abort"; the session
                                          │ rolls back to its last completed turn
                                          └ a second turn: error "session_busy"

The reader handles client messages in order; a live turn streams from its own task, so
cancel (and errors for whatever arrives meanwhile) are answered while it streams. A wrong
message gets an error message and changes nothing. `close` aborts a live turn, closes the
session and answers "closed" (the connection stays, and may open another). However the
connection ends (the client closes it or vanishes, the server stops), the live turn is
aborted and the session closed. Turns go through the gateway like HTTP requests (the 429 cap,
/abort_request by their rid "turn-...", metrics, abort at shutdown, stream_writer.py's cuts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from typing import Any

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from shoal.api.http.body import too_deep
from shoal.api.http.errors import INTERNAL, ApiError, FieldNames, bad_request, from_validation
from shoal.api.http.gateway import Gateway
from shoal.api.http.job import Job
from shoal.api.http.json_depth import nests_deeper
from shoal.api.http.openai_params import chat_messages
from shoal.api.http.relay import relay
from shoal.api.http.sessions import open_session
from shoal.api.http.stream_writer import stream_policy, write_within
from shoal.api.http.submission import Choice, PromptInput, Submission
from shoal.api.http.ws_protocol import (
    Cancel,
    ClientMessage,
    Close,
    Closed,
    Error,
    Open,
    Opened,
    ServerMessage,
    Turn,
    TurnFormat,
)
from shoal.api.sampling_wire import sampling_from, wire_names, wire_values
from shoal.api.session import Session
from shoal.results import EngineDeadError, RequestError

log = logging.getLogger("shoal.http")

HEARTBEAT_S = 30.0  # ping a quiet client this often; one that does not answer is gone


class SessionSockets:
    """The websocket route, and every connection open on it (for shutdown)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.max_message_bytes = gateway.limits.max_ws_message_bytes  # larger: closed, 1009
        self.decoder = msgspec.json.Decoder(ClientMessage)
        self.open: set[SessionSocket] = set()

    async def connect(self, request: web.Request) -> web.WebSocketResponse:
        # aiohttp refuses a frame of exactly max_msg_size bytes: allow max_message_bytes
        limit = self.max_message_bytes + 1
        ws = web.WebSocketResponse(max_msg_size=limit, heartbeat=HEARTBEAT_S)
        await ws.prepare(request)
        socket = SessionSocket(self.gateway, ws, self.decoder, request)
        self.open.add(socket)
        try:
            await socket.serve()
        except ConnectionError:
            pass  # the client is gone, or was cut (it read nothing): its session is closed
        finally:
            self.open.discard(socket)
        return ws

    async def shutdown(self, timeout_s: float) -> None:
        """Close every connection (their sessions with them) and wait for that to finish."""
        sockets = list(self.open)
        if sockets:
            await asyncio.gather(*(s.going_away(timeout_s) for s in sockets))
            await asyncio.wait([s.ended for s in sockets], timeout=timeout_s)


class SessionSocket:
    def __init__(
        self,
        gateway: Gateway,
        ws: web.WebSocketResponse,
        decoder: msgspec.json.Decoder[Any],
        request: web.Request,
    ) -> None:
        self.gateway = gateway
        self.ws = ws
        self.decoder = decoder
        self.request = request
        self.policy = stream_policy(request)  # each send bounded by its write_timeout_s
        self.session: Session | None = None
        self.job: Job | None = None  # the live turn's, until its done is about to be sent
        self.turns: set[asyncio.Task[None]] = set()  # streaming, or finishing after done
        self.sending = asyncio.Lock()
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def serve(self) -> None:
        """Answer messages until the connection ends; then release what it holds."""
        try:
            async for message in self.ws:
                if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await self.handle(message.data)
        finally:
            # Shielded: a handler cancelled twice (client gone, then shutdown) still cleans up.
            ending = asyncio.ensure_future(self.end_session())
            ending.add_done_callback(self._ended)
            await asyncio.shield(ending)

    def _ended(self, _: asyncio.Future[None]) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    async def handle(self, raw: str | bytes) -> None:
        try:
            data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
            limits = self.gateway.limits
            if len(data) > limits.max_ws_message_bytes:  # only a compressed frame gets here
                raise bad_request(
                    f"the message is {len(data)} bytes, more than the limit of "
                    f"{limits.max_ws_message_bytes} (max_ws_message_bytes)",
                    None,
                    "message_too_big",
                )
            max_depth = limits.max_json_depth
            if nests_deeper(data, max_depth):  # before msgspec recurses into it
                raise too_deep("the message", max_depth)
            message = self.decoder.decode(data)
            match message:
                case Open():
                    await self.open(message)
                case Turn():
                    await self.turn(message)
                case Cancel():
                    if self.job is not None:  # none: the turn has just ended; nothing to do
                        self.job.abort()
                case Close():
                    await self.close()
        except msgspec.ValidationError as exc:
            error = from_validation(exc)
            text = error.message.replace("invalid request body", "invalid message", 1)
            await self.send(Error(text, error.code, error.param))
        except msgspec.DecodeError as exc:
            await self.send(Error(f"the message is not valid JSON: {exc}", "invalid_json"))
        except ApiError as exc:
            await self.send(Error(exc.message, exc.code, exc.param))
        except ConnectionError:
            raise
        except Exception:  # a bug: say so, and keep the connection
            log.exception("websocket message failed: %r", raw[:200])
            await self.send(Error(INTERNAL, "internal_error"))

    async def open(self, message: Open) -> None:
        if self.session is not None:
            raise bad_request(
                f"session {self.session.id!r} is already open on this connection: close it first"
            )
        opening = asyncio.ensure_future(
            open_session(self.gateway, message.timeout_s, message.max_tokens, self.request.remote)
        )
        try:
            session_id = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the client left meanwhile: what opens, serve() closes
            with contextlib.suppress(Exception):
                self.session = Session(self.gateway.engine, await opening)
            raise
        self.session = Session(self.gateway.engine, session_id)
        await self.send(Opened(session_id))

    async def turn(self, message: Turn) -> None:
        if self.session is None:
            raise bad_request('no session is open: send {"type": "open"} first', "type")
        if self.job is not None:
            raise ApiError(
                409,
                f"session {self.session.id!r} already has a turn in progress: one turn at a time",
                code="session_busy",
            )
        arrived_at = time.monotonic()
        values = wire_values(message, "websocket")
        stops = (values.get("stop"), values.get("stop_token_ids"))
        self.gateway.check_stops(*stops, "", values.get("stop_regex"))
        prompt = self.turn_input(message)
        names = self.sampling_names(message, values)
        rid = f"turn-{uuid.uuid4().hex}"
        choice = Choice(rid, prompt, sampling_from(values))
        turn = Submission(rid, [choice], arrived_at, names, self.session.id)
        job = self.gateway.submit(turn)
        self.job = job
        task = asyncio.create_task(self.stream(job), name=f"shoal-ws-{rid}")
        self.turns.add(task)
        task.add_done_callback(self.turns.discard)

    async def stream(self, job: Job) -> None:
        """Send the turn's deltas, then its done (or the error that refused it)."""
        async with job:
            try:
                await relay(job, TurnFormat(self.done_follows), self.send, checked=False)
            except ApiError as exc:
                self.job = None
                if exc.status == 404:  # closed or reaped behind this connection's back
                    self.session = None
                param = None if exc.status in (404, 409) else exc.param  # not session_params
                await self.send(Error(exc.message, exc.code, param))
            except ConnectionError:
                pass  # the client is gone; leaving `async with job` aborts the turn

    def done_follows(self) -> None:
        self.job = None  # before done goes out: the client may answer at once

    async def close(self) -> None:
        if self.session is None:
            raise bad_request("no session is open on this connection", "type")
        session_id = self.session.id
        await self.end_session()
        await self.send(Closed(session_id))

    async def end_session(self) -> None:
        """Abort the live turn (its done still goes out if the client is there), then close
        the session; the engine defers the close until the turn's KV is released."""
        session, self.session = self.session, None
        if self.job is not None:
            self.job.abort()
        if self.turns:
            await asyncio.wait(list(self.turns))
        if session is not None:
            # Dead: nothing left to release. Not open: reaped after its timeout already.
            with contextlib.suppress(EngineDeadError, RequestError):
                await session.close()

    async def going_away(self, timeout_s: float) -> None:
        """The shutdown's close frame, bounded like a send (and by timeout_s): else a cut."""
        code, message = WSCloseCode.GOING_AWAY, b"server shutting down"
        with contextlib.suppress(ConnectionError):
            close = functools.partial(self.ws.close, code=code, message=message)
            await write_within(close, self.request, self.policy, timeout_s)

    async def send(self, message: ServerMessage) -> None:
        """A client that takes nothing for write_timeout_s is cut (StreamStalled)."""
        if self.ws.closed:
            return
        text = msgspec.json.encode(message).decode()
        async with self.sending:
            await write_within(lambda: self.ws.send_str(text), self.request, self.policy)

    # ---- a turn message into the engine's terms -------------------------------------------

    def turn_input(self, message: Turn) -> PromptInput:
        """The turn's new input, counted here; the engine encodes it and measures it against
        the session's whole history."""
        given = [n for n in ("text", "input_ids", "messages") if getattr(message, n) is not None]
        if len(given) != 1:
            raise bad_request("a turn needs exactly one of text, input_ids or messages", "text")
        gateway = self.gateway
        if message.text is not None:
            if not message.text:
                raise bad_request("text must not be empty", "text")
            gateway.check_prompt_size(message.text, None, "text")
            return PromptInput(name="text", text=message.text)
        if message.input_ids is not None:
            if not message.input_ids:
                raise bad_request("input_ids must not be empty", "input_ids")
            return PromptInput(name="input_ids", input_ids=message.input_ids)
        messages = chat_messages(gateway, message.messages or [])
        return PromptInput(name="messages", messages=messages)

    def sampling_names(self, message: Turn, values: dict[str, Any]) -> FieldNames:
        """The names the turn's fields were sent by (max_tokens is max_new_tokens's OpenAI
        name, moved into `values`), for its refusals."""
        names = wire_names("websocket")
        if message.max_tokens is not None:
            if values.get("max_new_tokens", message.max_tokens) != message.max_tokens:
                raise bad_request("give max_tokens or max_new_tokens, not both", "max_tokens")
            values["max_new_tokens"], names["max_new_tokens"] = message.max_tokens, "max_tokens"
        return FieldNames(session="session_params.id", sampling=names)
