"""Operator routes: health, model and server info, aborts, Prometheus metrics.

    GET  /health            200 while the process and its engine are alive (no API key needed)
    GET  /health_generate   a one-token generation through the scheduler; answered at once
                            when tokens were produced within the last `recent_s` seconds,
                            and while paused: 200 {"status": "paused"} (alive, by intent
                            not generating; a liveness probe must not restart it)
    GET  /get_model_info    model_path, served name, weight_version, context length, vocab
                            (also GET /model_info, SGLang's newer name)
    GET  /get_weight_version {"weight_version": "<the weights' version, a string>"} (slime's)
    GET  /get_server_info   resolved config plus live accounting (running, waiting, pages, ...)
    POST /abort_request     {"rid": "..."} or {"abort_all": true} -> {"aborted": N}
    GET  /metrics           Prometheus text format

The engine's lifecycle operations (flush_cache, update_weights_from_disk, pause / continue
generation) are in http_lifecycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from shoal import __name__ as package_name
from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import ApiError, FieldNames, bad_request, from_engine
from shoal.api.http.gateway import Gateway
from shoal.api.http.limits import check_id
from shoal.api.http.metrics import CONTENT_TYPE, Metrics, spec_rates
from shoal.api.http.native_protocol import AbortRequest
from shoal.models.registry import family_of
from shoal.params import SamplingParams


class WeightVersion(msgspec.Struct, frozen=True):
    """GET /get_weight_version's answer (slime polls it after an update)."""

    weight_version: str


HEALTH_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
INPUT_IDS = FieldNames("input_ids")  # the health generation's prompt


class AdminRoutes:
    def __init__(
        self,
        gateway: Gateway,
        metrics: Metrics,
        model_names: list[str],
        server_settings: dict[str, Any],
        health_timeout_s: float,
        recent_s: float = 5.0,
    ) -> None:
        self.gateway = gateway
        self.engine = gateway.engine
        self.metrics = metrics
        self.model_names = model_names
        self.server_settings = server_settings
        self.health_timeout_s = health_timeout_s
        self.recent_s = recent_s

    @property
    def weight_version(self) -> str:
        try:
            return self.engine.weight_version
        except Exception as exc:
            raise from_engine(exc, FieldNames()) from None

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.dead_reason is not None:
            raise ApiError(503, f"the engine is dead: {self.engine.dead_reason}")
        return json_response({"status": "ok"})

    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy if tokens are flowing; otherwise prove it with a one-token generation.
        Paused, no generation can run until /continue_generation: say so at once rather than
        time out into a 503 that reads as a hung server."""
        if self.engine.dead_reason is not None:
            raise ApiError(503, f"the engine is dead: {self.engine.dead_reason}")
        if self.engine.paused:
            resumes = "paused: generation resumes on /continue_generation"
            return json_response({"status": "paused", "checked": resumes})
        if time.monotonic() - self.metrics.last_token_at < self.recent_s:
            return json_response({"status": "ok", "checked": "recent tokens"})
        rid = f"health-{uuid.uuid4().hex}"
        try:
            stream = self.engine.generate(input_ids=[0], sampling=HEALTH_SAMPLING, rid=rid)
        except Exception as exc:
            raise from_engine(exc, INPUT_IDS) from None
        async with stream:
            try:
                done = await asyncio.wait_for(stream.result(), self.health_timeout_s)
            except TimeoutError:
                raise ApiError(
                    503, f"no token from the scheduler within {self.health_timeout_s}s"
                ) from None
            except Exception as exc:
                raise from_engine(exc, INPUT_IDS) from None
        if done.finish_reason not in ("stop", "length"):
            raise ApiError(503, f"health generation ended with {done.finish_reason}")
        return json_response({"status": "ok", "checked": "generation"})

    async def model_info(self, request: web.Request) -> web.Response:
        loaded = self.engine.loaded
        assert loaded is not None
        return json_response(
            {
                "model_path": str(loaded.path),
                "served_model_name": self.model_names[0],
                "weight_version": self.weight_version,
                "context_length": self.gateway.context_length,
                "max_position_embeddings": loaded.config.max_position_embeddings,
                "model_type": loaded.config.model_type,
                "family": family_of(loaded.config.model_type).name,
                "sliding_window": loaded.config.sliding_window,
                "vocab_size": loaded.config.vocab_size,
                "is_generation": True,
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return json_response(WeightVersion(str(self.weight_version)))

    async def server_info(self, request: web.Request) -> web.Response:
        engine = self.engine
        resolved = engine.resolved
        loaded = engine.loaded
        assert resolved is not None and loaded is not None
        try:
            snapshot = await engine.snapshot()
            cache = await engine.cache_stats()
            stages = engine.stage_microbatches()
            transfer = await engine.transfer_stats()
        except Exception as exc:
            raise from_engine(exc, FieldNames()) from None
        options = engine.options
        rate, per_step = spec_rates(snapshot)
        return json_response(
            {
                "version": package_version(),
                "model_path": str(loaded.path),
                "served_model_name": self.model_names[0],
                "weight_version": self.weight_version,
                "engine_options": dataclasses.asdict(engine.options),
                "resolved": {
                    "context_length": resolved.context_length,
                    "dtype": str(resolved.dtype).removeprefix("torch."),
                    "kv_cache_dtype": str(resolved.kv_dtype).removeprefix("torch."),
                    "device": str(resolved.device),
                    **dataclasses.asdict(resolved.cache),
                },
                "server": self.server_settings,
                "startup_s": engine.startup_s,
                "running": len(snapshot.prefill) + len(snapshot.running),
                "waiting": len(snapshot.waiting) + len(snapshot.retracting),
                "finishing": len(snapshot.finishing),
                "idle": snapshot.idle,
                "num_retractions": snapshot.num_retractions,
                # speculative decoding since start (README, "Speculative decoding")
                "speculative": {
                    "algorithm": options.speculative_algorithm,
                    "verify_steps": snapshot.spec_steps,
                    "draft_tokens": snapshot.spec_drafted,
                    "accepted_tokens": snapshot.spec_accepted,
                    "acceptance_rate": rate,
                    "accepted_per_step": per_step,
                },
                # microbatches launched and not yet back, and how many sit in each stage
                "in_flight_batches": len(snapshot.launched_batches),
                "stage_microbatches": list(stages),
                # prefill/decode disaggregation (docs/disaggregation.md): the role, the
                # transfer backend, and the rooms in each state (its queues)
                "disaggregation_mode": options.disaggregation_mode,
                "disaggregation_transfer_backend": options.disaggregation_transfer_backend,
                "disaggregation_bootstrap_port": engine.bootstrap_port,
                "weights_digest": engine.weights_digest,  # what the two servers compare
                "disaggregation_queues": transfer.rooms,
                "disaggregation_transferred": {
                    "transfers": transfer.transfers,
                    "bytes": transfer.bytes,
                    "seconds": round(transfer.seconds, 6),
                },
                "open_http_requests": self.gateway.num_open,
                "free_pages": cache.free_pages,
                "total_pages": cache.total_pages,
                "cached_tokens": cache.cached_tokens,
                "cache": cache,
            }
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await decode_body(request, AbortRequest)
        if body.abort_all:
            return json_response({"aborted": self.gateway.abort_all()})
        if not body.rid:
            raise bad_request("give rid, or abort_all: true", "rid")
        check_id(body.rid, self.gateway.limits, "rid")
        aborted = self.gateway.abort(body.rid)
        if not aborted:
            self.engine.abort(body.rid)  # not started over HTTP: let the engine look
        return json_response({"aborted": aborted})

    async def prometheus(self, request: web.Request) -> web.Response:
        try:
            snapshot = await self.engine.snapshot()
            cache = await self.engine.cache_stats()
            stages = self.engine.stage_microbatches()
            rooms = await self.engine.transfer_counts()
        except Exception as exc:
            raise from_engine(exc, FieldNames()) from None
        text = self.metrics.render(snapshot, cache, stages, rooms)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE})


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package_name)
    except PackageNotFoundError:
        return "unknown"
