"""Prometheus metrics for one server: its own CollectorRegistry, never the global default.

Counters and histograms are fed per engine request (one per choice) by a `RequestTimer`; the
gauges (running, waiting, KV usage, prefix-cache hit rate) are read from the engine when
`/metrics` is scraped, so they are never stale.

    shoal_requests_total{finish_reason}           stop | length | abort | error
    shoal_prompt_tokens_total, shoal_cached_prompt_tokens_total, shoal_generation_tokens_total
    shoal_num_running_requests, shoal_num_waiting_requests
    shoal_kv_cache_usage_ratio                     held pages / all (evictable cache is not held)
    shoal_kv_cache_free_pages, shoal_kv_cache_evictable_pages, shoal_kv_cache_total_pages
    shoal_prefix_cache_hit_rate                    cached / prompt tokens since start
    shoal_time_to_first_token_seconds, shoal_inter_token_latency_seconds,
    shoal_e2e_request_latency_seconds              histograms
    shoal_spec_verify_steps_total, shoal_spec_draft_tokens_total,
    shoal_spec_accepted_tokens_total               speculative decoding (read when scraped)
    shoal_spec_acceptance_rate, shoal_spec_accepted_per_step
    shoal_http_requests_total{route, status}
    shoal_http_stream_cuts_total                   streams cut: the client read nothing in time
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    exposition,
    generate_latest,
)

from shoal.actors.replies import SchedulerSnapshot
from shoal.cache.stats import KVStats
from shoal.results import FINISH_REASONS, Completion

CONTENT_TYPE = exposition.CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "shoal_requests", "Engine requests finished, by reason", ["finish_reason"], registry=r
        )
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.prompt_tokens = Counter("shoal_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "shoal_cached_prompt_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.generation_tokens = Counter("shoal_generation_tokens", "Output tokens", registry=r)
        self.running = Gauge("shoal_num_running_requests", "Prefilling or decoding", registry=r)
        self.waiting = Gauge("shoal_num_waiting_requests", "Waiting for admission", registry=r)
        self.kv_usage = Gauge(
            "shoal_kv_cache_usage_ratio",
            "KV pages held (not free, not evictable prefix cache) / all KV pages",
            registry=r,
        )
        self.evictable_pages = Gauge(
            "shoal_kv_cache_evictable_pages", "Prefix-cache pages no request uses", registry=r
        )
        self.free_pages = Gauge("shoal_kv_cache_free_pages", "Free KV pages", registry=r)
        self.total_pages = Gauge("shoal_kv_cache_total_pages", "KV pages", registry=r)
        self.hit_rate = Gauge(
            "shoal_prefix_cache_hit_rate", "Cached / all prompt tokens since start", registry=r
        )
        self.ttft = Histogram(
            "shoal_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shoal_inter_token_latency_seconds",
            "Between streamed tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "shoal_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.stage_microbatches = Gauge(
            "shoal_stage_microbatches",
            "Microbatches in each pipeline stage (stage 0: the only one without stages)",
            ["stage"],
            registry=r,
        )
        self.rooms = Gauge(
            "shoal_disaggregation_rooms",
            "Disaggregated requests' rooms in each state: prefill side bootstrap, prefilling, "
            "transferring; decode side waiting, cancelling (0 when idle)",
            ["state"],
            registry=r,
        )
        self.spec_steps = Gauge(
            "shoal_spec_verify_steps_total",
            "Speculating decodes verified since start (one row's drafts in one step)",
            registry=r,
        )
        self.spec_drafted = Gauge(
            "shoal_spec_draft_tokens_total", "Drafted tokens verified since start", registry=r
        )
        self.spec_accepted = Gauge(
            "shoal_spec_accepted_tokens_total", "Drafted tokens kept since start", registry=r
        )
        self.spec_rate = Gauge(
            "shoal_spec_acceptance_rate", "Kept / verified drafts since start", registry=r
        )
        self.spec_per_step = Gauge(
            "shoal_spec_accepted_per_step",
            "Tokens a speculating decode emitted on average (kept drafts and one more)",
            registry=r,
        )
        self.http = Counter(
            "shoal_http_requests",
            "HTTP answers by route and status",
            ["route", "status"],
            registry=r,
        )
        self.stream_cuts = Counter(
            "shoal_http_stream_cuts",
            "Streams cut because the client read nothing for stream_write_timeout_s",
            registry=r,
        )
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.last_token_at = 0.0  # time.monotonic() of the newest token seen on any request

    def timer(self, arrived_at: float) -> RequestTimer:
        return RequestTimer(self, arrived_at)

    def finished(self, completion: Completion, e2e_s: float) -> None:
        usage = completion.usage
        self.requests.labels(completion.finish_reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.num_prompt_tokens += usage.prompt_tokens
        self.num_cached_tokens += usage.cached_tokens
        self.e2e.observe(e2e_s)

    def render(
        self,
        snapshot: SchedulerSnapshot,
        cache: KVStats,
        stages: tuple[int, ...] = (0,),
        rooms: dict[str, int] | None = None,
    ) -> bytes:
        """The exposition text, gauges refreshed from a fresh snapshot, cache stats, the
        microbatches in each pipeline stage and disaggregation's rooms in each state."""
        for stage, count in enumerate(stages):
            self.stage_microbatches.labels(str(stage)).set(count)
        for state, count in (rooms or {}).items():
            self.rooms.labels(state).set(count)
        self.running.set(len(snapshot.prefill) + len(snapshot.running))
        self.waiting.set(len(snapshot.waiting) + len(snapshot.retracting))
        total = cache.total_pages
        self.total_pages.set(total)
        self.free_pages.set(cache.free_pages)
        self.evictable_pages.set(cache.evictable_pages)
        held = total - cache.free_pages - cache.evictable_pages
        self.kv_usage.set(held / total if total else 0.0)
        rate, per_step = spec_rates(snapshot)
        self.spec_steps.set(snapshot.spec_steps)
        self.spec_drafted.set(snapshot.spec_drafted)
        self.spec_accepted.set(snapshot.spec_accepted)
        self.spec_rate.set(rate)
        self.spec_per_step.set(per_step)
        prompt = self.num_prompt_tokens
        self.hit_rate.set(self.num_cached_tokens / prompt if prompt else 0.0)
        return generate_latest(self.registry)


def spec_rates(snapshot: SchedulerSnapshot) -> tuple[float, float]:
    """Speculative decoding's acceptance rate and tokens emitted per verification (0: none)."""
    steps, drafted, accepted = snapshot.spec_steps, snapshot.spec_drafted, snapshot.spec_accepted
    rate = accepted / drafted if drafted else 0.0
    per_step = (accepted + steps) / steps if steps else 0.0
    return rate, per_step


class RequestTimer:
    """Times one engine request from its HTTP arrival: first token, gaps, end."""

    def __init__(self, metrics: Metrics, arrived_at: float) -> None:
        self.metrics = metrics
        self.arrived_at = arrived_at
        self.last_at: float | None = None
        self.done = False

    def tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_at is None:
            self.metrics.ttft.observe(now - self.arrived_at)
        else:
            self.metrics.itl.observe((now - self.last_at) / num_tokens)
        self.last_at = now
        self.metrics.last_token_at = now

    def finish(self, completion: Completion) -> None:
        if not self.done:
            self.done = True
            self.metrics.finished(completion, time.monotonic() - self.arrived_at)

    def failed(self, counted: bool) -> None:
        """The request ended in an exception (engine dead: counted as an error)."""
        if not self.done:
            self.done = True
            if counted:
                self.metrics.requests.labels("error").inc()

    def gone(self) -> None:
        """The request ended without a Completion reaching us (client gone, engine dead)."""
        if not self.done:
            self.done = True
            self.metrics.requests.labels("abort").inc()
