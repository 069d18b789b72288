"""Two cbserve replicas behind SGLang's model gateway: ``cache_aware`` against ``round_robin`` on a workload of
a few long shared documents with many questions each (TTFT, throughput, prefix-cache hit rate).

    python -m bench.gateway --replicas 2 --num-docs 3 --questions 8 --burst 2 --num-blocks 24 --concurrency 2

The questions arrive interleaved across the documents in bursts of ``--burst`` questions on one document
(doc 0, 0, 1, 1, 2, 2, 0, 0, ... for 2), ``--concurrency`` at a time. With bursts of two sent two at a time,
``round_robin`` sends every document to both replicas; each replica's cache (``--num-blocks``) holds about
two documents, so cycling through three evicts each one before it comes back. ``cache_aware`` keeps each
document on one replica, where it stays cached. (One request at a time, sglang-router 0.3.2's
``cache_aware`` sends every prompt that matches no tree to the same replica: loads tie at zero.) Both policies' gateways route over the same
replicas, whose prefix caches are flushed (``POST /flush_cache``) before each run. The hit rate is read from
the replicas' ``cbserve:prefix_cache_*`` counters; TTFT from the first streamed chunk of each request.

Needs ``sglang-router`` (``pip install sglang-router``). Prints one JSON line per policy.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.gateway_cluster import Cluster, gateway_installed

REQUEST_TIMEOUT_S = 120.0
# Common words: most are one token each, so a document's length in tokens is close to its length in words.
WORDS = (
    "the of and to in is was for on are with as his they at be this from have or by one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much before go good new write our used me man too any day same right look think"
).split()


@dataclass(frozen=True)
class Question:
    doc: int
    prompt: str


@dataclass(frozen=True)
class Outcome:
    ok: bool
    ttft_s: float  # request sent -> first streamed chunk (nan when it failed first)
    num_tokens: int
    error: str = ""


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    num_requests: int
    num_failed: int
    ttft_p50_s: float
    ttft_p90_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prefix_cache_hit_rate: float
    wall_s: float


def document(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def shared_documents(
    num_docs: int, questions_per_doc: int, doc_words: int, burst: int = 1, seed: int = 0
) -> list[Question]:
    """The documents' questions, interleaved across documents in bursts of ``burst`` questions on one
    document (doc 0, 0, 1, 1, 2, 2, 0, 0, ... for 2)."""
    docs = [document(seed * 1000 + d, doc_words) for d in range(num_docs)]
    return [
        Question(
            d, f"{docs[d]}\n\nQuestion {q}: what does the text say about {WORDS[(7 * q + d) % len(WORDS)]}?"
        )
        for first in range(0, questions_per_doc, burst)
        for d in range(num_docs)
        for q in range(first, min(first + burst, questions_per_doc))
    ]


def send(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Outcome:
    """One streamed completion of exactly ``max_tokens`` tokens (``ignore_eos``); its usage comes last."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = float("nan")
    num_tokens = 0
    try:
        with client.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                return Outcome(False, ttft, 0, f"HTTP {r.status_code}: {r.read().decode()[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return Outcome(False, ttft, num_tokens, str(chunk["error"])[:200])
                if chunk.get("choices") and math.isnan(ttft):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Outcome(False, ttft, num_tokens, repr(exc))
    ok = num_tokens == max_tokens
    return Outcome(ok, ttft, num_tokens, "" if ok else f"{num_tokens} of {max_tokens} tokens")


def run(url: str, model: str, questions: list[Question], concurrency: int, max_tokens: int) -> list[Outcome]:
    """Every question through ``url``, ``concurrency`` at a time, in order of submission."""
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda q: send(client, url, model, q.prompt, max_tokens), questions))


def run_policy(
    cluster: Cluster, policy: str, questions: list[Question], concurrency: int, max_tokens: int
) -> PolicyResult:
    """The workload through a fresh gateway with ``policy``, from empty prefix caches."""
    url = cluster.add_gateway(policy)
    cluster.flush_caches()
    before = cluster.counts()
    start = time.perf_counter()
    outcomes = run(url, cluster.model, questions, concurrency, max_tokens)
    wall = time.perf_counter() - start
    ttfts = sorted(o.ttft_s for o in outcomes if o.ok)
    return PolicyResult(
        policy=policy,
        num_requests=len(outcomes),
        num_failed=sum(not o.ok for o in outcomes),
        ttft_p50_s=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p90_s=ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan"),
        requests_per_s=len(ttfts) / wall,
        output_tokens_per_s=sum(o.num_tokens for o in outcomes) / wall,
        prefix_cache_hit_rate=cluster.hit_rate(before),
        wall_s=wall,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-docs", type=int, default=3)
    parser.add_argument("--questions", type=int, default=8, help="questions per document")
    parser.add_argument("--doc-words", type=int, default=150)
    parser.add_argument("--burst", type=int, default=2, help="consecutive questions on one document")
    parser.add_argument(
        "--num-blocks", type=int, default=24, help="each replica's KV cache, in 16-token blocks"
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    parser.add_argument(
        "--threads-per-replica", type=int, default=None, help="OMP_NUM_THREADS of each replica"
    )
    parser.add_argument("--replica-args", default="", help="more `cbserve serve` flags, space-separated")
    args = parser.parse_args(argv)
    if not gateway_installed():
        print("sglang-router is not installed: pip install sglang-router", file=sys.stderr)
        return 2
    questions = shared_documents(args.num_docs, args.questions, args.doc_words, args.burst)
    with tempfile.TemporaryDirectory(prefix="cbserve-gateway-") as logs:
        cluster = Cluster(Path(logs))
        try:
            replica_args = ["--num-blocks", str(args.num_blocks), *args.replica_args.split()]
            cluster.start(args.replicas, replica_args, args.threads_per_replica)
            for policy in args.policies:
                result = run_policy(cluster, policy, questions, args.concurrency, args.max_tokens)
                print(json.dumps(asdict(result)), flush=True)
        finally:
            cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
