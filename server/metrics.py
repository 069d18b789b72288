"""Prometheus metrics for GET /metrics, named as vLLM names them (prefix ``cbserve:``) so existing
dashboards and alerts carry over by changing the prefix.

One ``Metrics`` object per server, with its own ``CollectorRegistry`` (never the process-global one, so
tests and several apps in one process do not collide). Who calls what:

- the HTTP layer: ``observe_finished(out)`` once per finished sample, ``refresh(stats)`` before rendering
  (gauges and the engine's cumulative counters), ``render()`` for the response body, and
  ``HTTPMetricsMiddleware`` (or ``Metrics.http_middleware(app)``) around the ASGI app;
- the engine thread: ``observe_step(num_tokens)`` once per step. prometheus-client's metric objects are
  thread-safe; the one piece of our own state (the last seen cumulative counters) has a lock.

A few gauges are also exported under vLLM's own names (``vllm:``), the ones a gateway's endpoint picker
reads from each replica (the Gateway API Inference Extension's model server protocol): queue length, running
requests, KV-cache usage (under its current and its former name), the cache's block size and LoRA state.

Every metric name and its meaning is listed in docs/METRICS.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from itertools import pairwise
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from engine.outputs import GenerationOutput, RequestStatus
from engine.stats import EngineStats
from scheduler.request import FinishReason

PREFIX = "cbserve:"
VLLM_PREFIX = "vllm:"  # the aliases an endpoint picker reads

# Bucket boundaries as vLLM's (vllm/v1/metrics/loggers.py), so quantiles are comparable across servers.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# HTTP durations include whole SSE streams, hence the long tail.
HTTP_DURATION_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

FINISHED_REASONS: tuple[str, ...] = tuple(r.value for r in FinishReason)  # stop, length, abort, error
UNMATCHED_ROUTE = "unmatched"


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


def finished_reason_label(out: GenerationOutput) -> str:
    """The ``finished_reason`` label of a finished sample: cancelled -> abort, failed -> error, else the
    engine's reason (stop when it gave none)."""
    if out.status is RequestStatus.CANCELLED:
        return FinishReason.ABORT.value
    if out.status is RequestStatus.FAILED:
        return FinishReason.ERROR.value
    return (out.finish_reason or FinishReason.STOP).value


class Metrics:
    """The server's metrics, registered in ``self.registry``.

    ``block_size * num_blocks`` (the most tokens the KV cache can hold, so the most any request can
    have) bounds the token-count histogram buckets unless ``max_model_len`` is given.
    """

    def __init__(
        self, model_name: str, block_size: int, num_blocks: int, *, max_model_len: int | None = None
    ) -> None:
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive integer or None, got {max_model_len!r}")
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        token_buckets = build_1_2_5_buckets(max_model_len or block_size * num_blocks)
        reg = self.registry
        m = ["model_name"]

        # --- scheduler state (set by refresh) ---
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running",
            "Requests admitted by the scheduler (holding KV blocks).",
            m,
            registry=reg,
        ).labels(model_name)
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting",
            "Requests queued for admission (new or preempted).",
            m,
            registry=reg,
        ).labels(model_name)
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1.", m, registry=reg
        ).labels(model_name)
        self.num_grammar_matchers = Gauge(
            PREFIX + "num_grammar_matchers",
            "Grammar matchers held by unfinished constrained samples.",
            m,
            registry=reg,
        ).labels(model_name)
        # NOTE: prometheus-client appends `_total` to counters: these are exposed as `<name>_total`.
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=reg
        ).labels(model_name)
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, registry=reg
        ).labels(model_name)
        self.num_preemptions = Counter(
            PREFIX + "num_preemptions",
            "Requests preempted (blocks freed, recomputed later).",
            m,
            registry=reg,
        ).labels(model_name)

        # --- speculative decoding (vLLM's names; set by refresh) ---
        self.spec_decode_num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts",
            "Verify chunks: a sequence's drafts checked in one step.",
            m,
            registry=reg,
        ).labels(model_name)
        self.spec_decode_num_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", m, registry=reg
        ).labels(model_name)
        self.spec_decode_num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, registry=reg
        ).labels(model_name)
        self._spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the drafts (0: the first).",
            [*m, "position"],
            registry=reg,
        )

        # --- finished requests (observe_finished) ---
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", m, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated by finished samples.", m, registry=reg
        ).labels(model_name)
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished samples by finish reason.",
            [*m, "finished_reason"],
            registry=reg,
        )
        for reason in FINISHED_REASONS:  # every series exists from the start, so rate() sees a zero
            self._request_success.labels(model_name, reason)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            m,
            buckets=ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.time_per_output_token = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per sample: (finish - first token) / (generated tokens - 1).",
            m,
            buckets=ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish.",
            m,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduled.",
            m,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt length of finished requests.",
            m,
            buckets=token_buckets,
            registry=reg,
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Generated length of finished samples.",
            m,
            buckets=token_buckets,
            registry=reg,
        ).labels(model_name)

        # --- engine steps (observe_step, engine thread) ---
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total",
            "Tokens computed per engine step.",
            m,
            buckets=ITERATION_TOKENS_BUCKETS,
            registry=reg,
        ).labels(model_name)

        # --- configuration ---
        Info(PREFIX + "cache_config", "KV-cache configuration.", m, registry=reg).labels(model_name).info(
            {"block_size": str(block_size), "num_blocks": str(num_blocks)}
        )

        # --- vLLM's names for what an endpoint picker reads (set by refresh) ---
        self.vllm_num_requests_waiting = Gauge(
            VLLM_PREFIX + "num_requests_waiting", "Alias of cbserve:num_requests_waiting.", m, registry=reg
        ).labels(model_name)
        self.vllm_num_requests_running = Gauge(
            VLLM_PREFIX + "num_requests_running", "Alias of cbserve:num_requests_running.", m, registry=reg
        ).labels(model_name)
        self.vllm_kv_cache_usage_perc = Gauge(
            VLLM_PREFIX + "kv_cache_usage_perc", "Alias of cbserve:kv_cache_usage_perc.", m, registry=reg
        ).labels(model_name)
        self.vllm_gpu_cache_usage_perc = Gauge(
            VLLM_PREFIX + "gpu_cache_usage_perc", "Alias of cbserve:kv_cache_usage_perc (vLLM's former name).",
            m, registry=reg,
        ).labels(model_name)
        Gauge(
            VLLM_PREFIX + "cache_config_info", "KV-cache configuration (the block size a prefix-aware picker reads).",
            [*m, "block_size", "num_gpu_blocks"], registry=reg,
        ).labels(model_name, str(block_size), str(num_blocks)).set(1)
        # NOTE: cbserve serves no LoRA adapters: the series says so (max_lora 0), so that a picker set up for
        # vLLM's LoRA affinity finds its metric, and no adapter on this replica.
        self.vllm_lora_requests_info = Gauge(
            VLLM_PREFIX + "lora_requests_info", "LoRA adapters (none); the value is the last update time.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=reg,
        ).labels("0", "", "")

        # --- HTTP (HTTPMetricsMiddleware) ---
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests by method, route template and status.",
            ["method", "route", "status"],
            registry=reg,
        )
        self.http_request_duration = Histogram(
            PREFIX + "http_request_duration_seconds",
            "HTTP request duration (for streams: until the last byte is sent).",
            ["method", "route"],
            buckets=HTTP_DURATION_BUCKETS,
            registry=reg,
        )

        # Last cumulative engine counters seen by refresh(): counters advance by the difference.
        self._lock = threading.Lock()
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._last_preemptions = 0
        self._last_spec: dict[str, int] = {}

    # ------------------------------------------------------------------ engine -> metrics

    def observe_finished(self, out: GenerationOutput) -> None:
        """Record one finished sample (status FINISHED, CANCELLED or FAILED; a RUNNING output is ignored,
        so a caller may pass every output it sees).

        Per request (recorded by the sample with ``index == 0`` only, so n > 1 counts a prompt once):
        prompt tokens, TTFT, queue time, end-to-end latency. Per sample: ``request_success_total`` by
        finish reason, generated tokens, inter-token latencies (from ``out.timestamps`` when present) and
        time per output token. Times missing from ``out`` (e.g. a request cancelled before it was
        scheduled) are skipped, never recorded as zero.
        """
        if not out.is_finished:
            return
        self._request_success.labels(self.model_name, finished_reason_label(out)).inc()
        num_generated = len(out.generated_ids)
        self.generation_tokens.inc(num_generated)
        self.request_generation_tokens.observe(num_generated)
        if out.index == 0:
            self.prompt_tokens.inc(len(out.prompt_ids))
            self.request_prompt_tokens.observe(len(out.prompt_ids))
            if out.first_token_time is not None:
                self.time_to_first_token.observe(out.first_token_time - out.arrival_time)
            if out.first_scheduled_time is not None:
                self.request_queue_time.observe(out.first_scheduled_time - out.arrival_time)
            if out.finish_time is not None:
                self.e2e_request_latency.observe(out.finish_time - out.arrival_time)
        if out.timestamps:
            for previous, current in pairwise(out.timestamps):
                self.inter_token_latency.observe(current - previous)
        if num_generated > 1 and out.first_token_time is not None and out.finish_time is not None:
            self.time_per_output_token.observe((out.finish_time - out.first_token_time) / (num_generated - 1))

    def observe_step(self, num_tokens: int) -> None:
        """Record one engine step that computed ``num_tokens`` tokens (thread-safe)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.iteration_tokens.observe(num_tokens)

    def refresh(self, stats: EngineStats) -> None:
        """Set the gauges from a snapshot and advance the counters that ``EngineStats`` keeps as totals.

        A total smaller than the last one seen means the engine was rebuilt with fresh counters: its
        whole value is then the increase.
        """
        self.num_requests_running.set(stats.num_requests_running)
        self.num_requests_waiting.set(stats.num_requests_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_grammar_matchers.set(stats.num_grammar_matchers)
        self.vllm_num_requests_waiting.set(stats.num_requests_waiting)
        self.vllm_num_requests_running.set(stats.num_requests_running)
        self.vllm_kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.vllm_gpu_cache_usage_perc.set(stats.kv_cache_usage)
        self.vllm_lora_requests_info.set(time.time())
        with self._lock:
            self._last_prefix_queries = _advance(
                self.prefix_cache_queries, self._last_prefix_queries, stats.prefix_cache_queries
            )
            self._last_prefix_hits = _advance(
                self.prefix_cache_hits, self._last_prefix_hits, stats.prefix_cache_hits
            )
            self._last_preemptions = _advance(
                self.num_preemptions, self._last_preemptions, stats.num_preemptions
            )
            self._refresh_spec_decode(stats)

    def _refresh_spec_decode(self, stats: EngineStats) -> None:
        totals: dict[str, tuple[Any, int]] = {
            "drafts": (self.spec_decode_num_drafts, stats.spec_num_drafts),
            "draft_tokens": (self.spec_decode_num_draft_tokens, stats.spec_num_draft_tokens),
            "accepted": (self.spec_decode_num_accepted_tokens, stats.spec_num_accepted_tokens),
        }
        for position, total in enumerate(stats.spec_accepted_per_position):
            if total or f"pos{position}" in self._last_spec:
                counter = self._spec_accepted_per_pos.labels(self.model_name, str(position))
                totals[f"pos{position}"] = (counter, total)
        for key, (counter, total) in totals.items():
            self._last_spec[key] = _advance(counter, self._last_spec.get(key, 0), total)

    # ------------------------------------------------------------------ HTTP

    def observe_http(self, method: str, route: str, status: int, duration_s: float) -> None:
        """Record one HTTP request (called by ``HTTPMetricsMiddleware``)."""
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_request_duration.labels(method, route).observe(duration_s)

    def http_middleware(self, app: ASGIApp) -> HTTPMetricsMiddleware:
        """``app`` wrapped so that every HTTP request is counted and timed."""
        return HTTPMetricsMiddleware(app, metrics=self)

    def render(self) -> tuple[bytes, str]:
        """The exposition (body, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _advance(counter: Any, last: int, total: int) -> int:
    """Increment ``counter`` by ``total - last`` (or ``total`` after a reset); return the new ``last``."""
    increase = total - last if total >= last else total
    if increase > 0:
        counter.inc(increase)
    return total


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HTTPMetricsMiddleware:
    """Pure ASGI middleware: counts and times HTTP requests by method, route template and status.

    NOTE: pure ASGI rather than Starlette's ``BaseHTTPMiddleware``, which buffers through a memory stream
    and interferes with SSE streaming and client disconnects. The route label is the matched route's
    template (``scope["route"].path``, set by Starlette's router on the shared scope dict), never the raw
    path, so the label set stays bounded; requests no route matched are labelled ``unmatched``.
    Usage: ``app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)``.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app raises before starting a response
        start = time.perf_counter()

        async def send_recording_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_recording_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None)
            self.metrics.observe_http(
                scope.get("method", "GET"),
                template if isinstance(template, str) and template else UNMATCHED_ROUTE,
                status,
                time.perf_counter() - start,
            )
