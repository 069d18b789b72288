"""cbserve replicas behind SGLang's model gateway (PyPI ``sglang-router``), as local processes on 127.0.0.1:
what bench/gateway.py measures and tests/deploy/test_gateway_live.py checks.

``Cluster.start`` launches the replicas (``cbserve serve`` from this checkout, each its own process and KV
cache) and waits for their ``/health``; ``add_gateway`` launches one gateway per routing policy over the same
replicas (``python -m sglang_router.launch_router``, its Prometheus port on 127.0.0.1 too); ``close`` ends
every process it started. Several gateways can share the replicas: ``flush_caches`` empties the replicas'
prefix caches between two policies' runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]  # the checkout: ``python -m cli.main`` runs its code
GATEWAY_MODULE = "sglang_router.launch_router"
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gateway_installed() -> bool:
    """Whether ``sglang-router`` can be imported by this interpreter."""
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float, path: str = "/health") -> None:
    """Until ``url + path`` answers 200; ``RuntimeError`` when the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} was not healthy within {timeout:.0f} s")


def prefix_cache_counts(url: str) -> tuple[float, float]:
    """A replica's (prompt tokens looked up in its prefix cache, of which found), from /metrics."""
    totals = {"cbserve:prefix_cache_queries": 0.0, "cbserve:prefix_cache_hits": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.name in totals:
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["cbserve:prefix_cache_queries"], totals["cbserve:prefix_cache_hits"]


@dataclass
class Process:
    url: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]


@dataclass
class Cluster:
    """Replicas and gateways on 127.0.0.1; ``logs`` holds their output files."""

    logs: Path
    model: str = "gateway-bench"
    replicas: list[Process] = field(default_factory=list)
    gateways: list[Process] = field(default_factory=list)

    def start(
        self, num_replicas: int, replica_args: list[str], threads_per_replica: int | None = None
    ) -> None:
        """Launch the replicas together (they load the model in parallel) and wait for all of them.
        ``threads_per_replica`` (OMP_NUM_THREADS): replicas sharing a machine should share out its cores."""
        env = {} if threads_per_replica is None else {"OMP_NUM_THREADS": str(threads_per_replica)}
        for i in range(num_replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--served-model-name", self.model, "--log-level", "warning", *replica_args]
            self.replicas.append(self._launch(f"replica{i}", f"http://127.0.0.1:{port}", cmd, env))
        for replica in self.replicas:
            wait_healthy(replica.url, replica.popen, STARTUP_TIMEOUT_S)

    def add_gateway(self, policy: str, extra_args: Sequence[str] = ()) -> str:
        """A gateway routing over every replica with ``policy``; its base URL once it routes."""
        port = free_port()
        cmd = [sys.executable, "-m", GATEWAY_MODULE, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", *(r.url for r in self.replicas), "--policy", policy]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        # NOTE: a dead replica is noticed at its first failed request (the circuit breaker opens, the
        # request is retried on another replica) or within a second by the health check.
        cmd += [
            "--cb-failure-threshold",
            "1",
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
        ]
        cmd += ["--log-level", "warn", *extra_args]
        gateway = self._launch(f"gateway{len(self.gateways)}-{policy}", f"http://127.0.0.1:{port}", cmd)
        self.gateways.append(gateway)
        wait_healthy(gateway.url, gateway.popen, STARTUP_TIMEOUT_S, path="/readiness")
        return gateway.url

    def flush_caches(self) -> None:
        for replica in self.replicas:
            if replica.popen.poll() is None:
                httpx.post(replica.url + "/flush_cache", timeout=30).raise_for_status()

    def hit_rate(self, before: list[tuple[float, float]]) -> float:
        """Prefix-cache hits / lookups over the live replicas since ``before`` (``counts()`` then)."""
        after = self.counts()
        queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        return hits / queries if queries else 0.0

    def counts(self) -> list[tuple[float, float]]:
        return [prefix_cache_counts(r.url) for r in self.replicas]

    def kill_replica(self, index: int) -> None:
        """SIGKILL: no drain, as a crashed node."""
        self.replicas[index].popen.send_signal(signal.SIGKILL)
        self.replicas[index].popen.wait(STOP_TIMEOUT_S)

    def close(self) -> None:
        for process in [*self.gateways, *self.replicas]:
            if process.popen.poll() is None:
                process.popen.terminate()
        for process in [*self.gateways, *self.replicas]:
            try:
                process.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait(STOP_TIMEOUT_S)
            process.log.close()

    def _launch(self, name: str, url: str, cmd: list[str], env: dict[str, str] | None = None) -> Process:
        log = (self.logs / f"{name}.log").open("wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        popen = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        return Process(url, popen, log)
