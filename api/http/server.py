"""The HTTP server: OpenAI-compatible and native routes over one started Engine, on aiohttp.

    async with Engine(model) as engine:
        async with Server(engine, ServerOptions(port=0)) as server:   # port 0: pick a free one
            print(server.url)                                       # http://127.0.0.1:43121
            ...

The server does not own the engine: stopping it aborts every open request (their streams
end with an error event and `data: [DONE]`), answers 503 to anything new, waits for handlers
to finish, and leaves the engine running and consistent for its owner to close.

Middlewares, outermost first: HTTP metrics (counts the final status) -> errors (every
failure in the one error shape) -> draining (503 while stopping) -> origin (403) -> API and
admin keys (401 / 403) -> JSON content type (415); the last three are http_guard's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web
from aiohttp.typedefs import Handler

from shoal.api.engine import Engine
from shoal.api.http.admin import AdminRoutes, package_version
from shoal.api.http.body import BODY_TIMEOUT_S, MAX_JSON_DEPTH
from shoal.api.http.bootstrap_fields import RoomRefusals
from shoal.api.http.errors import ApiError, error_middleware
from shoal.api.http.gateway import Gateway
from shoal.api.http.guard import Guard, parse_origins
from shoal.api.http.hosts import HostCheck, parse_hosts
from shoal.api.http.lifecycle import LifecycleRoutes
from shoal.api.http.limits import HttpLimits
from shoal.api.http.loads import LoadRoutes
from shoal.api.http.metrics import Metrics
from shoal.api.http.native import NativeRoutes
from shoal.api.http.openai_routes import OpenAIRoutes
from shoal.api.http.openapi import OpenAPIRoute
from shoal.api.http.reasoning import PARSERS as REASONING_PARSERS
from shoal.api.http.route_table import ROUTES
from shoal.api.http.routing import Route, add_routes
from shoal.api.http.sessions import SessionRoutes
from shoal.api.http.stream_writer import (
    DEFAULT_KEEPALIVE_S,
    DEFAULT_WRITE_TIMEOUT_S,
    STREAM_POLICY,
    StreamPolicy,
)
from shoal.api.http.tokenize_routes import TokenizeRoutes
from shoal.api.http.tool_parsers import PARSERS as TOOL_PARSERS
from shoal.api.http.weight_routes import WeightRoutes
from shoal.api.http.ws_sessions import SessionSockets

HTTP_LIMITS = HttpLimits()  # the defaults of the input-limit options below


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the loaded model folder's name
    max_body_bytes: int = 32 * 2**20  # larger request bodies answer 413
    max_queued_requests: int = 1024  # open engine requests beyond the running slots: then 429
    max_n: int = 16  # choices per OpenAI request
    health_timeout_s: float = 20.0
    shutdown_timeout_s: float = 10.0
    # what a request must show and how fast it must arrive (api/http/guard.py)
    admin_api_key: str | None = None  # then the lifecycle routes need it instead of api_key
    # POST /update_weights_from_tensor: its body is a pickle (runs the sender's code), so it
    # is off unless asked for, and then only with an admin key (api/http/weight_routes.py)
    allow_pickled_weights: bool = False
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the server's own; "*": any
    # Host names besides IP literals, localhost and the bound name (api/http/hosts.py); "*": any
    allowed_hosts: tuple[str, ...] = ()
    body_timeout_s: float = 30.0  # a body not fully read by then answers 408
    header_timeout_s: float = 60.0  # a request head not complete by then: connection closed
    max_header_bytes: int = 8190  # the request line, and each header line: longer answers 400
    max_headers: int = 128  # header lines per request: more answer 400
    # streamed answers (SSE, the session websocket: api/http/stream_writer.py)
    stream_write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # a client reading nothing: cut
    sse_keepalive_s: float = DEFAULT_KEEPALIVE_S  # `: keep-alive` after this long idle; 0: none
    incremental_streaming_output: bool = False  # /generate events: only what is new (SGLang's)
    # chat answers: tool calls read for tool_choice auto (None: the template's format, if it
    # shows one) and a reasoning block split off (None: none): api/http/tool_parsers.py,
    # api/http/reasoning.py
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # input limits of the HTTP doors (api/http/limits.py, docs/limits.md)
    max_json_depth: int = HTTP_LIMITS.max_json_depth
    max_prompts: int = HTTP_LIMITS.max_prompts
    max_content_parts: int = HTTP_LIMITS.max_content_parts
    max_id_chars: int = HTTP_LIMITS.max_id_chars
    max_path_chars: int = HTTP_LIMITS.max_path_chars
    max_ws_message_bytes: int = HTTP_LIMITS.max_ws_message_bytes

    def http_limits(self) -> HttpLimits:
        return HttpLimits(**{name: getattr(self, name) for name in HttpLimits.__struct_fields__})

    def validate(self) -> None:
        self.http_limits().validate()
        for name in ("max_body_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("body_timeout_s", "header_timeout_s", "stream_write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.sse_keepalive_s >= 0:
            raise ValueError(f"sse_keepalive_s must be >= 0 (0: none), got {self.sse_keepalive_s}")
        for name in ("max_header_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.admin_api_key and self.admin_api_key == self.api_key:
            raise ValueError("admin_api_key must differ from api_key")
        if self.allow_pickled_weights and not self.admin_api_key:
            raise ValueError(
                "allow_pickled_weights needs an admin_api_key: unpickling a body runs code the "
                "sender chooses, so only the admin key may send one"
            )
        parse_origins(self.allowed_origins)
        parse_hosts(self.allowed_hosts)

    def public(self) -> dict[str, object]:
        """What /get_server_info may show: everything but the keys."""
        settings = dataclasses.asdict(self)
        settings["api_key"] = "<set>" if self.api_key else None
        settings["admin_api_key"] = "<set>" if self.admin_api_key else None
        return settings


class Server:
    def __init__(
        self,
        engine: Engine,
        options: ServerOptions | None = None,
        routes: Sequence[Route] = ROUTES,
    ) -> None:
        """`routes`: the route table it serves (route_table.py)."""
        self.routes = routes
        self.options = options or ServerOptions()
        self.options.validate()
        assert engine.loaded is not None, "start the engine before the server"
        self.engine = engine
        self.metrics = Metrics()
        max_open = engine.options.max_running_requests + self.options.max_queued_requests
        self.gateway = Gateway(engine, self.metrics, max_open, self.options.http_limits())
        self.sockets = SessionSockets(self.gateway)
        # The one name the OpenAI routes list and accept: never the local path (a converted
        # folder's path says where the cache is); the folder's name unless one is given.
        self.model_names = [self.options.served_model_name or engine.loaded.path.name]
        self.app = self._build_app()
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "the server is not started"
        host = self.options.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def _build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.options.max_body_bytes,
            middlewares=[
                self._count,
                error_middleware,
                RoomRefusals(self.engine, self.routes).middleware,
                self._draining,
                *Guard(
                    self.options.api_key,
                    self.options.admin_api_key,
                    self.options.allowed_origins,
                    HostCheck(self.options.allowed_hosts, self.options.host),
                    self.routes,
                ).middlewares(),
            ],
        )
        app[BODY_TIMEOUT_S] = self.options.body_timeout_s
        app[MAX_JSON_DEPTH] = self.options.max_json_depth
        app[STREAM_POLICY] = StreamPolicy(
            write_timeout_s=self.options.stream_write_timeout_s,
            keepalive_s=self.options.sse_keepalive_s,
            dropped=self.metrics.stream_cuts.inc,
        )
        owners = (  # the route classes whose handlers the table names
            OpenAIRoutes(
                self.gateway,
                self.model_names,
                self.options.max_n,
                self.options.tool_call_parser,
                self.options.reasoning_parser,
            ),
            NativeRoutes(
                self.gateway, self.options.incremental_streaming_output, self.options.max_n
            ),
            AdminRoutes(
                self.gateway,
                self.metrics,
                self.model_names,
                self.options.public(),
                self.options.health_timeout_s,
            ),
            LifecycleRoutes(self.engine),
            WeightRoutes(self.engine, self.gateway.limits, self.options.allow_pickled_weights),
            LoadRoutes(self.engine, package_version()),
            SessionRoutes(self.gateway),
            TokenizeRoutes(self.gateway, self.model_names),
            self.sockets,
            OpenAPIRoute(self.routes, self.options.api_key, self.options.admin_api_key),
        )
        add_routes(app, self.routes, owners)
        return app

    # ---- life ------------------------------------------------------------------------------

    async def start(self) -> str:
        """Listen; return the URL (with the real port when options.port is 0)."""
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,  # a client that goes away cancels its handler
            shutdown_timeout=self.options.shutdown_timeout_s,
            access_log=None,
            # aiohttp closes a connection whose next request head is not complete within
            # keepalive_timeout of its opening or of its previous answer (also the idle limit)
            keepalive_timeout=self.options.header_timeout_s,
            max_line_size=self.options.max_header_bytes,
            max_field_size=self.options.max_header_bytes,
            max_headers=self.options.max_headers,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.options.host, self.options.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.runner = runner
        sockets = [s for s in runner.addresses if isinstance(s, tuple)]
        self.port = int(sockets[0][1])
        return self.url

    async def stop(self) -> None:
        """Abort what is open (streams end with an error event), close the session
        websockets (and their sessions), then stop listening."""
        self.gateway.draining = True
        self.gateway.abort_all()
        await self.sockets.shutdown(self.options.shutdown_timeout_s)
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()
        late = list(self.gateway.late)
        if late:  # the ends of abandoned requests, for the metrics; bounded by the abort
            await asyncio.wait(late, timeout=self.options.shutdown_timeout_s)

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ---- middlewares -----------------------------------------------------------------------

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        self.metrics.http.labels(route, str(response.status)).inc()
        return response

    @web.middleware
    async def _draining(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.gateway.draining:
            raise ApiError(503, "the server is shutting down")
        return await handler(request)
