"""`GET /v1/loads`: how loaded the server is, in SGLang's shape, so RL loops and routers that
poll it (slime waits after `abort_request {"abort_all": true}` until running + waiting is 0)
read shoal as they read SGLang.

    GET /v1/loads?include=core&dp_rank=0
      -> {"timestamp": "<UTC ISO 8601>", "version": "<shoal's>",
          "loads": [{"timestamp", "dp_rank": 0, "num_running_reqs", "num_waiting_reqs",
                     "num_used_tokens", "num_total_tokens", "max_total_num_tokens",
                     "max_running_requests", "token_usage"}]}

One server is one data-parallel rank, 0: `dp_rank` 0 (or none) gives its load, another rank
an empty list. `include` takes SGLang's sections (core, memory, spec, lora, disagg, queues,
all, comma-separated); shoal answers the core fields for each, as it has no other section's
figures; a section SGLang does not know is a 400. `format=prometheus` is a 400 that names
`GET /metrics`. Running counts every request that holds a row (prefilling, decoding,
retracting, finishing); waiting those queued for one.

    GET /get_load
      -> [{"dp_rank": 0, "num_reqs", "num_waiting_reqs", "num_tokens"}]

SGLang's older route, one entry per data-parallel rank: what sglang-router reads of each
worker (its `GET /get_loads` sums `num_tokens` over the ranks, and its power_of_two policy
routes by it; without this route the router reports a shoal worker's load as -1).
`num_reqs` counts running and waiting, `num_tokens` the KV positions the live requests hold
(SGLang adds the waiting prompts' lengths, which shoal's snapshot does not carry).
"""

from __future__ import annotations

import datetime
import time

import msgspec
from aiohttp import web

from shoal.api.engine import Engine
from shoal.api.http.body import json_response
from shoal.api.http.errors import FieldNames, bad_request, from_engine

SECTIONS = frozenset(("core", "memory", "spec", "lora", "disagg", "queues", "all"))


class Load(msgspec.Struct, frozen=True):
    timestamp: float
    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int  # positions the live requests' pages hold
    num_total_tokens: int  # positions the KV pool holds
    max_total_num_tokens: int
    max_running_requests: int
    token_usage: float  # num_used_tokens / num_total_tokens


class Loads(msgspec.Struct, frozen=True):
    timestamp: str
    version: str
    loads: list[Load]


class RankLoad(msgspec.Struct, frozen=True):
    """One data-parallel rank's load in `GET /get_load`'s shape (SGLang's GetLoadReqOutput)."""

    dp_rank: int
    num_reqs: int  # running and waiting
    num_waiting_reqs: int
    num_tokens: int  # KV positions the live requests' pages hold


class LoadRoutes:
    def __init__(self, engine: Engine, version: str) -> None:
        self.engine = engine
        self.version = version

    async def loads(self, request: web.Request) -> web.Response:
        query = request.query
        asked = {s.strip() for s in query.get("include", "core").split(",") if s.strip()}
        if not asked <= SECTIONS:
            unknown = ", ".join(sorted(asked - SECTIONS))
            known = ", ".join(sorted(SECTIONS))
            raise bad_request(f"include: unknown section {unknown}; known: {known}", "include")
        if query.get("format", "json") != "json":
            raise bad_request("format: only json here; Prometheus text is GET /metrics", "format")
        rank = query.get("dp_rank")
        if rank is not None and not rank.isdigit():
            raise bad_request(f"dp_rank must be an integer >= 0, got {rank!r}", "dp_rank")
        now = time.time()
        stamp = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()
        if rank is not None and int(rank) != 0:
            return json_response(Loads(stamp, self.version, []))
        running, waiting, used, total = await self._core()
        load = Load(
            timestamp=now,
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_used_tokens=used,
            num_total_tokens=total,
            max_total_num_tokens=total,
            max_running_requests=self.engine.options.max_running_requests,
            token_usage=round(used / total, 4) if total else 0.0,
        )
        return json_response(Loads(stamp, self.version, [load]))

    async def rank_loads(self, request: web.Request) -> web.Response:
        running, waiting, used, _ = await self._core()
        return json_response([RankLoad(0, running + waiting, waiting, used)])

    async def _core(self) -> tuple[int, int, int, int]:
        """Requests running and waiting, KV positions the live requests hold, and the pool's."""
        try:
            snapshot = await self.engine.snapshot()
            cache = await self.engine.cache_stats()
        except Exception as exc:
            raise from_engine(exc, FieldNames()) from None
        page_size = self.engine.options.page_size
        used = (cache.request_pages + cache.locked_pages) * page_size
        return len(snapshot.rows), len(snapshot.waiting), used, cache.total_pages * page_size
