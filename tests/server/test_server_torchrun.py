"""`cbserve serve -tp 2` started by torchrun (two ranks on loopback, the tiny random Llama): the ranks meet at
torchrun's MASTER_ADDR:MASTER_PORT instead of a store cbserve spawns, rank 0 serves HTTP and rank 1 only
runs the forward; a greedy completion equals one process's, and a SIGTERM to rank 0 drains it, stops
rank 1 and ends torchrun with exit code 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_fixtures import free_port, serve_in_thread, wait_until

from engine.engine import Engine
from engine.loader.model_loader import load_tokenizer
from engine.model_config import ModelConfig
from server.app import build_app
from server.config import ServerConfig

pytestmark = pytest.mark.slow  # starts torchrun and two servers' processes

PROMPT = "The tide comes in, the tide goes out, and on the long grey pier the gulls"
CACHE = ["--num-blocks", "16", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, tiny_model_config: ModelConfig) -> Path:
    folder = tmp_path_factory.mktemp("tiny-torchrun")
    (folder / "config.json").write_text(json.dumps(tiny_model_config.replace(vocab_size=50001).to_hf_dict()))
    load_tokenizer("default").save(folder)
    return folder


def _completion(base: str, ids: list[int]) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    resp = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice: dict[str, Any] = resp.json()["choices"][0]
    return choice


def _rank(launcher: subprocess.Popen[bytes], rank: int) -> psutil.Process:
    """The worker torchrun started as ``rank`` (by its environment)."""
    workers = [p for p in psutil.Process(launcher.pid).children() if p.environ().get("RANK") == str(rank)]
    assert len(workers) == 1, workers
    return workers[0]


def test_torchrun_ranks_serve_one_process_completion(tiny_folder: Path, tmp_path: Path) -> None:
    one = Engine.from_pretrained(
        str(tiny_folder), load_format="dummy", device="cpu", num_blocks=16, max_model_len=256
    )
    ids = one.tokenizer.encode(PROMPT)
    with serve_in_thread(build_app(one, ServerConfig(served_model_name="tiny")), "tp1") as base:
        expected = _completion(base, ids)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    argv += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    argv += [
        "-m",
        "cli.main",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(tiny_folder),
    ]
    argv += ["--load-format", "dummy", "--device", "cpu", "-tp", "2", *CACHE]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CBSERVE_")}
    log = tmp_path / "torchrun.log"
    with log.open("wb") as out:
        launcher = subprocess.Popen(argv, stdout=out, stderr=out, env=env, cwd=Path(__file__).parents[2])
    try:

        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        # healthy once (a second look could time out on a loaded machine), or the process ended
        assert (
            wait_until(lambda: healthy() or launcher.poll() is not None, 120, 0.5) and launcher.poll() is None
        ), log.read_text()
        got = _completion(base, ids)
        assert got["text"] == expected["text"]
        want, have = expected["logprobs"]["token_logprobs"], got["logprobs"]["token_logprobs"]
        assert max(abs(x - y) for x, y in zip(want, have, strict=True)) < 1e-4
        rank0, rank1 = _rank(launcher, 0), _rank(launcher, 1)
        assert not [c for c in rank0.children() if "spawn_main" in " ".join(c.cmdline())]  # torchrun's ranks
        assert all(c.laddr.port != port for c in rank1.net_connections(kind="tcp"))  # rank 1 serves no HTTP
        rank0.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0, log.read_text()
    finally:
        if launcher.poll() is None:
            for child in psutil.Process(launcher.pid).children(recursive=True):
                child.kill()
            launcher.kill()
            launcher.wait(10)


def test_a_size_other_than_torchruns_world_is_refused(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process torchrun starts is one rank: -tp must be its WORLD_SIZE (else each would serve alone)."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError, match="started by torchrun with WORLD_SIZE=2: give tensor_parallel_size 2"
    ):
        Engine.from_pretrained(str(tiny_folder), load_format="dummy", device="cpu", num_blocks=16)
    monkeypatch.delenv("MASTER_PORT")
    one = Engine.from_pretrained(str(tiny_folder), load_format="dummy", device="cpu", num_blocks=16)
    assert one.num_blocks == 16  # without all of torchrun's variables nothing changes
