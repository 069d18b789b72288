"""Two cbserve replicas behind SGLang's model gateway (PyPI ``sglang-router``), all on 127.0.0.1
(bench/gateway_cluster.py): the gateway registers cbserve as a worker; on a few long documents whose questions
arrive in bursts of two, ``cache_aware`` routing gets a clearly higher prefix-cache hit rate than
``round_robin``; a replica killed mid-run loses at most its in-flight requests, and every later request
succeeds through the other.

Each replica has 24 blocks of 16 tokens: about two of the three 164-token documents. Skipped when
sglang-router is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.gateway import run, run_policy, send, shared_documents
from bench.gateway_cluster import Cluster, gateway_installed

pytestmark = [
    pytest.mark.slow,  # model-loading processes and the gateway
    pytest.mark.skipif(
        not gateway_installed(), reason="sglang-router is not installed (pip install sglang-router)"
    ),
]

QUESTIONS = shared_documents(num_docs=3, questions_per_doc=4, doc_words=150, burst=2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(Path(tmp_path_factory.mktemp("gateway")))
    try:
        # NOTE: one thread each: the two replicas share CI's two cores.
        c.start(
            2, ["--num-blocks", "24", "--max-model-len", "512", "--max-num-seqs", "4"], threads_per_replica=1
        )
        yield c
    finally:
        c.close()


def test_the_gateway_registers_cbserve_under_its_served_name(cluster: Cluster) -> None:
    url = cluster.add_gateway("power_of_two")
    workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r.url for r in cluster.replicas)
    assert {w["model_id"] for w in workers} == {cluster.model} and all(w["is_healthy"] for w in workers)
    with httpx.Client() as client:
        outcome = send(client, url, cluster.model, "Hello there", max_tokens=2)
    assert outcome.ok, outcome.error


def test_cache_aware_routing_beats_round_robin_on_shared_documents(cluster: Cluster) -> None:
    # NOTE: two questions on one document sent together: round robin gives one to each replica, whatever
    # their order of arrival. (Sent one at a time, cache_aware's unmatched prompts all go to one replica.)
    blind = run_policy(cluster, "round_robin", QUESTIONS, concurrency=2, max_tokens=1)
    aware = run_policy(cluster, "cache_aware", QUESTIONS, concurrency=2, max_tokens=1)
    assert blind.num_failed == aware.num_failed == 0
    assert aware.prefix_cache_hit_rate >= 0.5, (aware, blind)
    assert aware.prefix_cache_hit_rate >= blind.prefix_cache_hit_rate + 0.3, (aware, blind)


def test_a_killed_replica_loses_only_its_in_flight_requests(cluster: Cluster) -> None:
    url = cluster.add_gateway("cache_aware")
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(send, client, url, cluster.model, q.prompt, 8) for q in QUESTIONS]
        while sum(f.done() for f in pending) < 2:  # mid-run: some requests done, others running or queued
            time.sleep(0.05)
        cluster.kill_replica(1)
        outcomes = [f.result() for f in pending]
    assert sum(not o.ok for o in outcomes) <= 4, [o.error for o in outcomes if not o.ok]  # the in-flight ones
    later = run(url, cluster.model, QUESTIONS[:4], concurrency=2, max_tokens=1)
    assert all(o.ok for o in later), [o.error for o in later if not o.ok]
