"""The HTTP server: OpenAI-compatible and native routes over one started Engine, on aiohttp.

    async with Engine(model) as engine:
        async with Server(engine, ServerOptions(port=0)) as server:   # port 0: pick a free one
            print(server.url)                                       # http://127.0.0.1:43121
            ...

The server does not own the engine: stopping it aborts every open request (their streams
end with an error event and `data: [DONE]`), answers 503 to anything new, waits for handlers
to finish, and leaves the engine running and consistent for its owner to close.

Middlewares, outermost first: HTTP metrics (counts the final status) -> errors (every
failure in the one error shape) -> draining (503 while stopping) -> API key (401).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web
from aiohttp.typedefs import Handler

from shoal.api.engine import Engine
from shoal.api.http_admin import AdminRoutes
from shoal.api.http_errors import ApiError, error_middleware
from shoal.api.http_gateway import Gateway
from shoal.api.http_lifecycle import LifecycleRoutes
from shoal.api.http_native import NativeRoutes
from shoal.api.http_sessions import SessionRoutes
from shoal.api.metrics import Metrics
from shoal.api.openai_routes import OpenAIRoutes
from shoal.api.ws_sessions import SessionSockets

OPEN_ROUTES = frozenset({"/health"})  # answered without the API key


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

    def validate(self) -> None:
        for name in ("max_body_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")

    def public(self) -> dict[str, object]:
        """What /get_server_info may show: everything but the key."""
        settings = dataclasses.asdict(self)
        settings["api_key"] = "<set>" if self.api_key else None
        return settings


class Server:
    def __init__(self, engine: Engine, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        self.options.validate()
        assert engine.loaded is not None, "start the engine before the server"
        self.engine = engine
        self.metrics = Metrics()
        max_open = engine.options.max_running_requests + self.options.max_queued_requests
        self.gateway = Gateway(engine, self.metrics, max_open)
        self.sockets = SessionSockets(self.gateway, self.options.max_body_bytes)
        path = engine.loaded.path
        self.model_names = [self.options.served_model_name or path.name, str(path)]
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
            middlewares=[self._count, error_middleware, self._draining, self._authorize],
        )
        app.add_routes(OpenAIRoutes(self.gateway, self.model_names, self.options.max_n).routes())
        app.add_routes(NativeRoutes(self.gateway).routes())
        admin = AdminRoutes(
            self.gateway,
            self.metrics,
            self.model_names,
            self.options.public(),
            self.options.health_timeout_s,
        )
        app.add_routes(admin.routes())
        app.add_routes(LifecycleRoutes(self.engine).routes())
        app.add_routes(SessionRoutes(self.gateway).routes())
        app.add_routes(self.sockets.routes())
        return app

    # ---- life ------------------------------------------------------------------------------

    async def start(self) -> str:
        """Listen; return the URL (with the real port when options.port is 0)."""
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,  # a client that goes away cancels its handler
            shutdown_timeout=self.options.shutdown_timeout_s,
            access_log=None,
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

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.options.api_key
        if key and request.path not in OPEN_ROUTES:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise ApiError(
                    401, "missing or wrong API key: send the header Authorization: Bearer <key>"
                )
        return await handler(request)
