"""server/metrics.py: what the exposition says after fake outputs, stats, steps and HTTP requests."""

from __future__ import annotations

import threading

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import GenerationOutput, RequestStatus
from engine.stats import EngineStats
from scheduler.request import FinishReason
from server.metrics import HTTPMetricsMiddleware, Metrics, build_1_2_5_buckets

MODEL = "smollm2"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: Metrics) -> Samples:
    """Every sample of the exposition, keyed by (sample name, label set)."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    labels.setdefault("model_name", MODEL)
    return samples[(name, frozenset(labels.items()))]


def bucket(samples: Samples, name: str, le: str, **labels: str) -> float:
    return value(samples, name + "_bucket", le=le, **labels)


def finished(
    *,
    index: int = 0,
    prompt_len: int = 7,
    num_generated: int = 4,
    status: RequestStatus = RequestStatus.FINISHED,
    reason: FinishReason | None = FinishReason.STOP,
    timestamps: list[float] | None = None,
    arrival: float = 100.0,
    scheduled: float | None = 100.5,
    first_token: float | None = 100.75,
    finish: float | None = 103.75,
) -> GenerationOutput:
    return GenerationOutput(
        request_id="req-1",
        prompt_ids=list(range(prompt_len)),
        generated_ids=list(range(num_generated)),
        status=status,
        finish_reason=reason,
        index=index,
        timestamps=timestamps,
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=first_token,
        finish_time=finish,
    )


def stats(**overrides: float | int | bool) -> EngineStats:
    fields: dict = dict(
        num_requests_running=3, num_requests_waiting=5, kv_cache_usage=0.25, num_blocks=100, block_size=16,
        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, is_running=True,
    )  # fmt: skip
    fields.update(overrides)
    return EngineStats(**fields)


def test_exposes_vllm_names_with_prefix_model_label_and_cache_config() -> None:
    samples = scrape(Metrics(MODEL, block_size=16, num_blocks=100))
    names = {name for name, _ in samples}
    for counter in (
        "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
    ):  # fmt: skip
        assert value(samples, f"cbserve:{counter}_total") == 0.0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(samples, f"cbserve:{gauge}") == 0.0
    for histogram in (
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens",
        "iteration_tokens_total",
    ):  # fmt: skip
        assert {f"cbserve:{histogram}_bucket", f"cbserve:{histogram}_sum", f"cbserve:{histogram}_count"} <= names
    # Every finish reason has a series from the start, so rate() and dashboards see zeros, not gaps.
    for reason in ("stop", "length", "abort", "error"):
        assert value(samples, "cbserve:request_success_total", finished_reason=reason) == 0.0
    assert value(samples, "cbserve:cache_config_info", block_size="16", num_blocks="100") == 1.0
    # Token buckets follow vLLM's 1-2-5 series, bounded by what the cache can hold (16 * 100 tokens).
    prompt_buckets = {dict(labels)["le"] for name, labels in samples if name == "cbserve:request_prompt_tokens_bucket"}
    assert "1000.0" in prompt_buckets and "2000.0" not in prompt_buckets and "+Inf" in prompt_buckets


def test_observe_finished_records_tokens_latencies_and_reason() -> None:
    metrics = Metrics(MODEL, block_size=16, num_blocks=100)
    # 4 tokens, gaps 0.03125, 0.125, 0.5 (exact in binary, so no bucket edge is blurred by rounding).
    metrics.observe_finished(finished(timestamps=[100.75, 100.78125, 100.90625, 101.40625]))
    s = scrape(metrics)
    assert value(s, "cbserve:request_success_total", finished_reason="stop") == 1.0
    assert value(s, "cbserve:request_success_total", finished_reason="length") == 0.0
    assert value(s, "cbserve:prompt_tokens_total") == 7.0
    assert value(s, "cbserve:generation_tokens_total") == 4.0
    assert value(s, "cbserve:request_prompt_tokens_sum") == 7.0
    assert bucket(s, "cbserve:request_prompt_tokens", "5.0") == 0.0
    assert bucket(s, "cbserve:request_prompt_tokens", "10.0") == 1.0
    assert value(s, "cbserve:request_generation_tokens_sum") == 4.0
    # TTFT = 0.75 s (first token - arrival): in le=0.75, not in le=0.5.
    assert value(s, "cbserve:time_to_first_token_seconds_sum") == pytest.approx(0.75)
    assert bucket(s, "cbserve:time_to_first_token_seconds", "0.5") == 0.0
    assert bucket(s, "cbserve:time_to_first_token_seconds", "0.75") == 1.0
    # queue time = 0.5 s (first scheduled - arrival); e2e = 3.75 s (finish - arrival).
    assert value(s, "cbserve:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert bucket(s, "cbserve:request_queue_time_seconds", "0.5") == 1.0
    assert bucket(s, "cbserve:request_queue_time_seconds", "0.3") == 0.0
    assert value(s, "cbserve:e2e_request_latency_seconds_sum") == pytest.approx(3.75)
    assert bucket(s, "cbserve:e2e_request_latency_seconds", "2.5") == 0.0
    assert bucket(s, "cbserve:e2e_request_latency_seconds", "5.0") == 1.0
    # Three inter-token gaps, one per bucket boundary they fall under.
    assert value(s, "cbserve:inter_token_latency_seconds_count") == 3.0
    assert value(s, "cbserve:inter_token_latency_seconds_sum") == pytest.approx(0.65625)
    assert bucket(s, "cbserve:inter_token_latency_seconds", "0.025") == 0.0
    assert bucket(s, "cbserve:inter_token_latency_seconds", "0.05") == 1.0
    assert bucket(s, "cbserve:inter_token_latency_seconds", "0.15") == 2.0
    assert bucket(s, "cbserve:inter_token_latency_seconds", "0.4") == 2.0
    assert bucket(s, "cbserve:inter_token_latency_seconds", "0.5") == 3.0
    # Time per output token: (103.75 - 100.75) / 3 = 1.0 s.
    assert value(s, "cbserve:request_time_per_output_token_seconds_sum") == pytest.approx(1.0)


def test_n_samples_count_the_prompt_and_request_latencies_once() -> None:
    metrics = Metrics(MODEL, block_size=16, num_blocks=100)
    metrics.observe_finished(finished(index=0, num_generated=4))
    metrics.observe_finished(finished(index=1, num_generated=6, reason=FinishReason.LENGTH))
    s = scrape(metrics)
    assert value(s, "cbserve:prompt_tokens_total") == 7.0
    assert value(s, "cbserve:request_prompt_tokens_count") == 1.0
    assert value(s, "cbserve:time_to_first_token_seconds_count") == 1.0
    assert value(s, "cbserve:e2e_request_latency_seconds_count") == 1.0
    assert value(s, "cbserve:generation_tokens_total") == 10.0
    assert value(s, "cbserve:request_generation_tokens_count") == 2.0
    assert value(s, "cbserve:request_success_total", finished_reason="stop") == 1.0
    assert value(s, "cbserve:request_success_total", finished_reason="length") == 1.0


def test_cancelled_is_abort_failed_is_error_running_is_ignored_and_missing_times_are_skipped() -> None:
    metrics = Metrics(MODEL, block_size=16, num_blocks=100)
    # Cancelled while queued: never scheduled, no token, so no TTFT / queue time / ITL observation.
    metrics.observe_finished(
        finished(status=RequestStatus.CANCELLED, reason=None, num_generated=0, scheduled=None, first_token=None)
    )
    metrics.observe_finished(finished(status=RequestStatus.FAILED, reason=FinishReason.ERROR, index=0))
    metrics.observe_finished(finished(status=RequestStatus.RUNNING, reason=None))
    s = scrape(metrics)
    assert value(s, "cbserve:request_success_total", finished_reason="abort") == 1.0
    assert value(s, "cbserve:request_success_total", finished_reason="error") == 1.0
    assert value(s, "cbserve:request_success_total", finished_reason="stop") == 0.0
    assert value(s, "cbserve:prompt_tokens_total") == 14.0  # the RUNNING output added nothing
    assert value(s, "cbserve:time_to_first_token_seconds_count") == 1.0  # only the failed one had a token
    assert value(s, "cbserve:request_queue_time_seconds_count") == 1.0
    assert value(s, "cbserve:e2e_request_latency_seconds_count") == 2.0
    assert value(s, "cbserve:inter_token_latency_seconds_count") == 0.0  # no timestamps asked


def test_refresh_sets_gauges_and_advances_counters_by_the_delta() -> None:
    metrics = Metrics(MODEL, block_size=16, num_blocks=100)
    metrics.refresh(stats(prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=2))
    metrics.refresh(stats(prefix_cache_queries=150, prefix_cache_hits=40, num_preemptions=3, kv_cache_usage=0.5))
    s = scrape(metrics)
    assert value(s, "cbserve:num_requests_running") == 3.0
    assert value(s, "cbserve:num_requests_waiting") == 5.0
    assert value(s, "cbserve:kv_cache_usage_perc") == 0.5
    assert value(s, "cbserve:prefix_cache_queries_total") == 150.0
    assert value(s, "cbserve:prefix_cache_hits_total") == 40.0
    assert value(s, "cbserve:num_preemptions_total") == 3.0
    # The engine was rebuilt and its totals restarted from zero: the counter keeps rising, never falls.
    metrics.refresh(stats(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=0))
    s = scrape(metrics)
    assert value(s, "cbserve:prefix_cache_queries_total") == 160.0
    assert value(s, "cbserve:prefix_cache_hits_total") == 44.0
    assert value(s, "cbserve:num_preemptions_total") == 3.0


def test_observe_step_is_thread_safe() -> None:
    metrics = Metrics(MODEL, block_size=16, num_blocks=100)

    def steps() -> None:
        for _ in range(500):
            metrics.observe_step(8)

    threads = [threading.Thread(target=steps) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    s = scrape(metrics)
    assert value(s, "cbserve:iteration_tokens_total_count") == 2000.0
    assert value(s, "cbserve:iteration_tokens_total_sum") == 16000.0
    assert bucket(s, "cbserve:iteration_tokens_total", "1.0") == 0.0
    assert bucket(s, "cbserve:iteration_tokens_total", "8.0") == 2000.0
    with pytest.raises(ValueError, match="num_tokens"):
        metrics.observe_step(-1)


def test_instances_have_separate_registries() -> None:
    first, second = Metrics("a", 16, 10), Metrics("b", 16, 10)
    first.observe_step(3)
    assert ("cbserve:iteration_tokens_total_count", frozenset({("model_name", "a")})) in scrape(first)
    assert scrape(second)[("cbserve:iteration_tokens_total_count", frozenset({("model_name", "b")}))] == 0.0


@pytest.mark.parametrize(
    ("args", "message"),
    [(("", 16, 10), "model_name"), (("m", 0, 10), "block_size"), (("m", 16, -1), "num_blocks"),
     (("m", 16, True), "num_blocks")],
)  # fmt: skip
def test_invalid_config_raises_clear_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Metrics(*args)


def test_build_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    assert build_1_2_5_buckets(4) == (1.0, 2.0)


def test_http_middleware_labels_route_templates_and_statuses() -> None:
    metrics = Metrics(MODEL, block_size=16, num_blocks=100)
    app = FastAPI()
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)

    @app.get("/v1/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        return {"id": item_id}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():  # type: ignore[no-untyped-def]
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v1/items/1").status_code == 200
        assert client.get("/v1/items/2").status_code == 200
        assert client.get("/v1/items/x").status_code == 422
        assert client.post("/v1/items/1").status_code == 405
        assert client.get("/nope/123").status_code == 404
        assert client.get("/boom").status_code == 500
        assert client.get("/stream").text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"

    s = scrape(metrics)

    def requests(method: str, route: str, status: str) -> float:
        return s[("cbserve:http_requests_total", frozenset({"method": method, "route": route, "status": status}.items()))]

    assert requests("GET", "/v1/items/{item_id}", "200") == 2.0  # the template, not /v1/items/1
    assert requests("GET", "/v1/items/{item_id}", "422") == 1.0
    assert requests("POST", "/v1/items/{item_id}", "405") == 1.0
    assert requests("GET", "unmatched", "404") == 1.0
    assert requests("GET", "/boom", "500") == 1.0
    assert requests("GET", "/stream", "200") == 1.0
    assert not any("/v1/items/1" in str(labels) for _, labels in s)
    duration = s[("cbserve:http_request_duration_seconds_count", frozenset({"method": "GET", "route": "/v1/items/{item_id}"}.items()))]
    assert duration == 3.0


def test_http_middleware_method_wraps_an_asgi_app() -> None:
    metrics = Metrics(MODEL, block_size=16, num_blocks=100)
    inner = FastAPI()

    @inner.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    with TestClient(metrics.http_middleware(inner)) as client:  # type: ignore[arg-type]
        assert client.get("/health").status_code == 200
    s = scrape(metrics)
    assert s[("cbserve:http_requests_total", frozenset({"method": "GET", "route": "/health", "status": "200"}.items()))] == 1.0
