"""The arithmetic of every benchmark metric, on hand-made request records (bench/bench_metrics.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.bench_metrics import (
    RequestRecord,
    calculate_metrics,
    concurrent_requests_per_second,
    format_metrics,
    metrics_to_dict,
    output_tokens_per_second,
    peak_inflight,
    percentile_key,
    tpot_of,
)
from bench.compare import format_comparison, ratio


def _records() -> list[RequestRecord]:
    """Three successes and one failure over two seconds.

    r1: 4 chunks of one token at 0.10, 0.15, 0.20, 0.30 s; ends 0.35 s.
    r2: 2 chunks of two tokens at 0.70 and 1.30 s; ends 1.50 s.
    r3: failed.
    r4: 1 chunk of one token at 1.50 s; ends 1.50 s.
    """
    return [
        RequestRecord(10, 4, start_time=0.0, success=True, output_tokens=4, ttft=0.1,
                      itl=[0.05, 0.05, 0.1], latency=0.35, generated_text="abcd"),
        RequestRecord(20, 4, start_time=0.5, success=True, output_tokens=4, ttft=0.2, itl=[0.6], latency=1.0),
        RequestRecord(30, 4, start_time=0.6, success=False, error="HTTP 500: boom", ttft=0.05, itl=[0.01]),
        RequestRecord(5, 1, start_time=1.2, success=True, output_tokens=1, ttft=0.3, latency=0.3),
    ]


def test_counts_and_throughputs() -> None:
    m = calculate_metrics(_records(), duration=2.0)
    assert (m.completed, m.failed) == (3, 1)
    # Input tokens count successful requests only; a failed request outputs 0 tokens.
    assert m.total_input == 10 + 20 + 5
    assert m.total_output == 4 + 4 + 1
    assert m.output_lens == [4, 4, 0, 1]
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx((35 + 9) / 2.0)


def test_ttft_stats_in_ms() -> None:
    ttft = calculate_metrics(_records(), duration=2.0, percentiles=(50, 90, 99)).latencies["ttft"]
    # Samples 100, 200, 300 ms (the failed request's 50 ms is not one).
    assert ttft.mean == pytest.approx(200.0)
    assert ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx(math.sqrt((100.0**2 + 0 + 100.0**2) / 3))
    # numpy's linear interpolation: rank 0.99 * (3 - 1) = 1.98 -> 200 + 0.98 * 100.
    assert ttft.percentiles[99.0] == pytest.approx(298.0)
    assert ttft.percentiles[90.0] == pytest.approx(280.0)
    assert ttft.percentiles[50.0] == pytest.approx(200.0)


def test_tpot_excludes_first_token_and_single_token_outputs() -> None:
    records = _records()
    assert tpot_of(records[0]) == pytest.approx((0.35 - 0.1) / 3)
    assert tpot_of(records[1]) == pytest.approx((1.0 - 0.2) / 3)
    assert tpot_of(records[2]) is None  # failed
    assert tpot_of(records[3]) is None  # one output token: no time per *further* token
    tpot = calculate_metrics(records, duration=2.0).latencies["tpot"]
    expected = np.array([0.25 / 3, 0.8 / 3]) * 1000
    assert tpot.mean == pytest.approx(expected.mean())
    assert tpot.median == pytest.approx(np.median(expected))


def test_itl_pools_all_gaps_of_successful_requests() -> None:
    itl = calculate_metrics(_records(), duration=2.0, percentiles=(50,)).latencies["itl"]
    samples = np.array([0.05, 0.05, 0.1, 0.6]) * 1000  # the failed request's 10 ms gap is left out
    assert itl.mean == pytest.approx(samples.mean())
    assert itl.median == pytest.approx(75.0)
    assert itl.std == pytest.approx(samples.std())
    assert itl.percentiles[50.0] == pytest.approx(75.0)


def test_e2el_stats() -> None:
    e2el = calculate_metrics(_records(), duration=2.0).latencies["e2el"]
    assert e2el.mean == pytest.approx((350 + 1000 + 300) / 3)
    assert e2el.median == pytest.approx(350.0)


def test_output_tokens_per_second_buckets_weight_multi_token_chunks() -> None:
    # Bucket 0: r1's four 1-token chunks + r2's first 2-token chunk; bucket 1: r2's second chunk + r4.
    assert output_tokens_per_second(_records()) == pytest.approx([6.0, 3.0])
    assert calculate_metrics(_records(), duration=2.0).max_output_tokens_per_s == pytest.approx(6.0)
    # The buckets always sum to the output tokens of successful requests.
    assert sum(output_tokens_per_second(_records())) == pytest.approx(9.0)


def test_concurrency_per_second_and_exact_inflight() -> None:
    # r1 in second 0; r2 in seconds 0 and 1; r4 in second 1. At 1.3 s, r2 and r4 are both in flight.
    assert concurrent_requests_per_second(_records()) == [2, 2]
    assert peak_inflight(_records()) == 2
    # Three back-to-back requests within one second: vLLM's per-second count says 3, nothing overlapped.
    sequential = [
        RequestRecord(1, 1, start_time=t, success=True, output_tokens=1, ttft=0.1, latency=0.2)
        for t in (0.0, 0.3, 0.6)
    ]
    assert concurrent_requests_per_second(sequential) == [3]
    assert peak_inflight(sequential) == 1
    # One ends exactly when the next starts: not concurrent.
    touching = [
        RequestRecord(1, 1, start_time=0.0, success=True, output_tokens=1, ttft=0.1, latency=0.5),
        RequestRecord(1, 1, start_time=0.5, success=True, output_tokens=1, ttft=0.1, latency=0.5),
    ]
    assert peak_inflight(touching) == 1
    m = calculate_metrics(sequential, duration=1.0)
    assert (m.max_concurrent_requests, m.peak_inflight_requests) == (3, 1)


def test_all_failed_reports_zeros() -> None:
    failed = [RequestRecord(7, 3, error="HTTP 503: busy"), RequestRecord(7, 3, error="ConnectError: x")]
    m = calculate_metrics(failed, duration=0.5)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (0, 2, 0, 0)
    assert m.max_output_tokens_per_s == 0.0 and m.max_concurrent_requests == 0
    assert m.peak_inflight_requests == 0
    for stats in m.latencies.values():
        assert stats.mean == 0.0 and stats.percentiles[99.0] == 0.0


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics(_records(), duration=0.0)
    with pytest.raises(ValueError, match="percentiles"):
        calculate_metrics(_records(), duration=1.0, percentiles=(101,))


def test_result_dict_uses_vllm_key_names() -> None:
    records = _records()
    m = calculate_metrics(records, duration=2.0, percentiles=(50, 99.9))
    d = metrics_to_dict(m, records)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for key in (f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p50_{name}_ms",
                    f"p99.9_{name}_ms"):
            assert key in d
    assert d["p50_ttft_ms"] == pytest.approx(200.0)
    assert d["completed"] == 3 and d["failed"] == 1
    assert d["total_input_tokens"] == 35 and d["total_output_tokens"] == 9
    assert d["output_lens"] == [4, 4, 0, 1]
    assert d["input_lens"] == [10, 20, 30, 5]
    assert d["ttfts"] == [0.1, 0.2, 0.05, 0.3]  # per request, in seconds, as vLLM saves them
    assert d["itls"][0] == [0.05, 0.05, 0.1]
    assert d["errors"] == ["", "", "HTTP 500: boom", ""]
    assert d["generated_texts"][0] == "abcd"
    assert d["successes"] == [True, True, False, True]
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"


def test_printed_block_matches_vllm_layout() -> None:
    text = format_metrics(calculate_metrics(_records(), duration=2.0))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     3" in text
    assert "Failed requests:                         1" in text
    assert "Output token throughput (tok/s):         4.50" in text
    assert "Mean TTFT (ms):                          200.00" in text
    assert "P99 TTFT (ms):                           298.00" in text
    assert "-----Time per Output Token (excl. 1st token)------" in text
    assert "Median E2EL (ms):                        350.00" in text


def test_comparison_ratios_are_b_over_a() -> None:
    assert ratio(2.0, 3.0) == "1.500"
    assert ratio(0, 3.0) == "-"
    assert ratio(None, 1.0) == "-"
    a = {"completed": 4, "duration": 2.0, "output_throughput": 100.0, "mean_ttft_ms": 50.0, "p99_ttft_ms": 80.0}
    b = {"completed": 4, "duration": 1.0, "output_throughput": 250.0, "mean_ttft_ms": 25.0, "p99_ttft_ms": 20.0}
    table = format_comparison(a, b, "cbserve", "peer")
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:] if line.strip("-")}
    assert rows["output_throughput"][-1] == "2.500"
    assert rows["duration"][-1] == "0.500"
    assert rows["mean_ttft_ms"][-1] == "0.500"
    assert rows["p99_ttft_ms"][-1] == "0.250"
    assert rows["completed"][-1] == "1.000"
    assert "cbserve" in table.splitlines()[0] and "peer" in table.splitlines()[0]
