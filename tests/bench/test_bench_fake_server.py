"""The benchmark client end to end, against a fake OpenAI server with known timings; and its workloads.

The fake server (raw asyncio HTTP on 127.0.0.1, a free port, its own thread) answers GET /v1/models and
streams `max_tokens` content chunks per request: the first after `ttft` seconds, then one every `itl`
seconds, then a usage chunk and `data: [DONE]`. Requests are numbered in arrival order (the warm-up is
number 1) so that chosen ones can fail or be slow.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.datasets import (
    SampleRequest,
    TokenizerLike,
    sample_prefix_repetition_requests,
    sample_random_requests,
    sample_sharegpt_requests,
    special_token_ids,
)
from bench.serving import BenchConfig, arrival_offsets, build_payload, chunk_content, main, sse_data

# ----------------------------------------------------------------------------------------------- tokenizer


class MergingTokenizer:
    """A tiny greedy tokenizer with merges, so that decode -> encode does not round-trip: letters, space
    and a few bigrams; ids 0 and 1 are special (shown only when special tokens are not skipped)."""

    SPECIALS = ("<s>", "</s>")
    PIECES = (*SPECIALS, *"abcdefghijklmnopqrstuvwxyz ", "th", "he", "in", "er", "an", " t")

    def __init__(self) -> None:
        self.ids = {piece: i for i, piece in enumerate(self.PIECES)}

    @property
    def vocab_size(self) -> int:
        return len(self.PIECES)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for size in (4, 3, 2, 1):
                piece = text[i : i + size]
                if len(piece) == size and piece in self.ids:
                    out.append(self.ids[piece])
                    i += size
                    break
            else:
                i += 1  # unknown character: dropped
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(
            self.PIECES[i] for i in ids if not (skip_special_tokens and self.PIECES[i] in self.SPECIALS)
        )


def _tokenizer_loader(name: str) -> TokenizerLike:
    assert name == "default"
    return MergingTokenizer()


# ----------------------------------------------------------------------------------------------- fake server


@dataclass
class Behaviour:
    ttft: float = 0.05
    itl: float = 0.01
    chunk_text: str = "q"
    send_usage: bool = True
    http_error_on: set[int] = field(default_factory=set)  # request numbers answered with HTTP 500
    stream_error_on: set[int] = field(default_factory=set)  # an error event after two chunks
    slow_on: dict[int, float] = field(default_factory=dict)  # request number -> its itl


class FakeOpenAIServer:
    """Streams completions with known delays; records every request body and the peak open streams."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.num_requests = 0
        self.open_streams = 0
        self.peak_open_streams = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> FakeOpenAIServer:
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.server = server
        self.port = server.sockets[0].getsockname()[1]
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            # NOTE: handlers still sleeping for requests the client cancelled are ended here, so that no
            # task outlives the loop.
            self.server.close()
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            request_line, *header_lines = head.strip().split("\r\n")
            method, path, _ = request_line.split(" ")
            headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/v1/models":
                self._respond(
                    writer, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
                )
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await self._stream(writer, json.loads(body), headers, chat=path.endswith("chat/completions"))
            else:
                self._respond(writer, 404, {"error": {"message": f"no route {path}"}})
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away (a cancelled request): nothing to answer
        finally:
            writer.close()

    def _respond(self, writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + data
        )

    async def _stream(
        self, writer: asyncio.StreamWriter, body: dict[str, Any], headers: dict[str, str], chat: bool
    ) -> None:
        self.num_requests += 1
        number = self.num_requests
        self.bodies.append(body)
        self.headers.append(headers)
        b = self.behaviour
        if number in b.http_error_on:
            self._respond(writer, 500, {"error": {"message": "injected failure"}})
            return
        itl = b.slow_on.get(number, b.itl)
        self.open_streams += 1
        self.peak_open_streams = max(self.peak_open_streams, self.open_streams)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            if chat:  # a real chat stream opens with a role-only delta at once: it must not count as TTFT
                await self._event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(b.ttft)
            for i in range(int(body["max_tokens"])):
                if i:
                    await asyncio.sleep(itl)
                if number in b.stream_error_on and i == 2:
                    await self._event(writer, {"error": {"message": "injected stream error", "code": 500}})
                    return
                delta: dict[str, Any] = (
                    {"delta": {"content": b.chunk_text}} if chat else {"text": b.chunk_text}
                )
                await self._event(writer, {"choices": [{"index": 0, **delta, "finish_reason": None}]})
            last: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
            await self._event(writer, {"choices": [{"index": 0, **last, "finish_reason": "length"}]})
            if b.send_usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": int(body["max_tokens"]), "total_tokens": 0}
                await self._event(writer, {"choices": [], "usage": usage})
            writer.write(b"data: [DONE]\n\n")
        finally:
            self.open_streams -= 1

    @staticmethod
    async def _event(writer: asyncio.StreamWriter, payload: dict[str, Any]) -> None:
        writer.write(f"data: {json.dumps(payload)}\n\n".encode())
        await writer.drain()


@pytest.fixture
def make_server() -> Iterator[Any]:
    servers: list[FakeOpenAIServer] = []

    def start(**kwargs: Any) -> FakeOpenAIServer:
        server = FakeOpenAIServer(Behaviour(**kwargs)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def _run(
    server: FakeOpenAIServer, tmp_path: Path, *extra: str, name: str = "run"
) -> tuple[int, dict[str, Any]]:
    result_path = tmp_path / f"{name}.json"
    argv = [
        "--base-url",
        server.url,
        "--dataset",
        "random",
        "--num-prompts",
        "8",
        "--random-input-len",
        "12",
        "--random-output-len",
        "5",
        "--max-concurrency",
        "4",
        "--disable-tqdm",
        "--timeout",
        "30",
        "--save-result",
        str(result_path),
        *extra,
    ]
    rc = main(argv, tokenizer_loader=_tokenizer_loader)
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    return rc, result


# ----------------------------------------------------------------------------------------------- end to end


def test_known_timings_are_measured(
    make_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = make_server(ttft=0.05, itl=0.01)
    rc, r = _run(server, tmp_path, "--ignore-eos", "--plot", str(tmp_path / "run.png"))
    assert rc == 0
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["model_id"] == "fake-model"  # asked of GET /v1/models
    assert r["total_input_tokens"] == 8 * 12  # exact prompt lengths
    assert r["input_lens"] == [12] * 8
    assert r["total_output_tokens"] == 8 * 5  # the server's usage
    assert all(len(itls) == 4 for itls in r["itls"])  # 5 content chunks: 4 gaps; role/usage chunks excluded
    # Known delays: TTFT 50 ms, ITL 10 ms, E2EL 50 + 4 * 10 ms. Lower bounds are firm (the server sleeps at
    # least that long). Upper bounds only catch a wrong unit (x1000): a loaded 2-core CI machine has stalled
    # this client's event loop for 300 ms at a time, so a tight ceiling would test the machine, not the client.
    assert 45.0 <= r["mean_ttft_ms"] < 5_000.0
    assert 45.0 <= r["p99_ttft_ms"] < 5_000.0
    assert 5.0 <= r["mean_itl_ms"] < 1_000.0
    assert 5.0 <= r["mean_tpot_ms"] < 1_000.0
    assert 85.0 <= r["mean_e2el_ms"] < 10_000.0
    # Per request: the last token cannot arrive before it was sent (50 + 4 * 10 ms), and the parts add up
    # (the end comes after the first token plus every gap, the [DONE] a bit later). Single gaps have no floor:
    # tokens that arrive while the client is stalled are read together.
    for ttft, itls, latency in zip(r["ttfts"], r["itls"], r["latencies"], strict=True):
        assert ttft >= 0.045 and ttft + sum(itls) >= 0.085
        assert ttft + sum(itls) <= latency + 1e-9
    assert r["mean_tpot_ms"] == pytest.approx((r["mean_e2el_ms"] - r["mean_ttft_ms"]) / 4, rel=0.5)
    # The semaphore holds at most 4 requests in flight, seen from both ends.
    assert server.peak_open_streams <= 4
    assert 1 <= r["peak_inflight_requests"] <= 4
    # What was sent: 1 warm-up + 8, streamed with usage, max_tokens, ignore_eos, the listed model.
    assert server.num_requests == 9
    body = server.bodies[-1]
    assert body["model"] == "fake-model" and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert len(MergingTokenizer().encode(body["prompt"])) == 12
    # The warm-up is short and sends no measured prompt (a prefix cache would skip that prompt's prefill).
    warm, measured = server.bodies[0], [b["prompt"] for b in server.bodies[1:]]
    assert warm["max_tokens"] == 8 and warm["prompt"] not in measured
    assert not any(p.startswith(warm["prompt"][:8]) for p in measured)
    # Saved with vLLM's key names.
    for key in (
        "date",
        "backend",
        "model_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p90_itl_ms",
        "mean_e2el_ms",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "latencies",
        "generated_texts",
        "errors",
    ):
        assert key in r, key
    assert r["request_rate"] == "inf" and r["max_concurrency"] == 4 and r["backend"] == "openai"
    assert r["generated_texts"][0] == "qqqqq"
    assert r["output_throughput"] == pytest.approx(40 / r["duration"])
    assert r["max_output_tokens_per_s"] == pytest.approx(40.0)  # the whole run fits in its first second
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Successful requests:                     8" in printed
    png = (tmp_path / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_chat_endpoint_skips_role_chunk_and_counts_text_without_usage(
    make_server: Any, tmp_path: Path
) -> None:
    server = make_server(ttft=0.05, itl=0.01, chunk_text="qq", send_usage=False)
    rc, r = _run(
        server, tmp_path, "--endpoint", "/v1/chat/completions", "--model", "my-model", "--api-key", "sk-test"
    )
    assert rc == 0 and r["completed"] == 8 and r["backend"] == "openai-chat"
    # The role-only delta arrives at once; TTFT waits for the first content.
    assert min(r["ttfts"]) >= 0.045
    assert all(len(itls) == 4 for itls in r["itls"])
    # No usage: output tokens counted by the tokenizer ("qq" is two tokens per chunk).
    assert r["output_lens"] == [10] * 8
    body = server.bodies[-1]
    assert body["model"] == "my-model" and body["messages"][0]["role"] == "user"
    assert "ignore_eos" not in body
    assert server.headers[-1]["authorization"] == "Bearer sk-test"


def test_failed_requests_are_counted_and_their_errors_recorded(make_server: Any, tmp_path: Path) -> None:
    # Request 1 is the warm-up; of the 8 measured (2..9), 3 and 6 get HTTP 500, 5 breaks mid-stream.
    server = make_server(http_error_on={3, 6}, stream_error_on={5})
    rc, r = _run(server, tmp_path)
    assert rc == 0
    assert (r["completed"], r["failed"]) == (5, 3)
    errors = [e for e in r["errors"] if e]
    assert sorted(e.split(":")[0] for e in errors) == ["HTTP 500", "HTTP 500", "error event in stream"]
    assert "injected failure" in " ".join(errors) and "injected stream error" in " ".join(errors)
    failed = [i for i, e in enumerate(r["errors"]) if e]
    assert all(r["output_lens"][i] == 0 for i in failed)
    assert r["total_output_tokens"] == 5 * 5
    assert r["total_input_tokens"] == 5 * 12


def test_timeout_cancels_unfinished_requests(make_server: Any, tmp_path: Path) -> None:
    # Requests 1 and 2 are quick; 3 and 4 would take 15 s each. The 1.5 s timeout cancels them.
    server = make_server(slow_on={3: 3.0, 4: 3.0})
    began = time.monotonic()
    rc, r = _run(server, tmp_path, "--num-prompts", "4", "--num-warmups", "0", "--timeout", "1.5")
    elapsed = time.monotonic() - began
    assert rc == 0  # some requests succeeded
    assert elapsed < 10.0  # well short of the 15 s the slow requests would take
    assert r["timed_out"] is True
    assert (r["completed"], r["failed"]) == (2, 2)
    assert sum("cancelled" in e for e in r["errors"]) == 2
    assert 1.0 <= r["duration"] < 10.0


def test_timeout_before_requests_are_sent(make_server: Any, tmp_path: Path) -> None:
    # One at a time, 3 s each: the first is cancelled, the rest never leave the client.
    server = make_server(ttft=3.0)
    rc, r = _run(
        server,
        tmp_path,
        "--num-prompts",
        "3",
        "--num-warmups",
        "0",
        "--max-concurrency",
        "1",
        "--timeout",
        "0.5",
    )
    assert rc == 1  # nothing succeeded
    assert r["failed"] == 3 and r["completed"] == 0
    assert sum(e.startswith("cancelled") for e in r["errors"]) == 1
    assert sum(e.startswith("never sent") for e in r["errors"]) == 2
    assert server.num_requests == 1


def test_unreachable_server_and_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--num-prompts",
        "2",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
        "--disable-tqdm",
        "--timeout",
        "10",
    ]
    assert main(base, tokenizer_loader=_tokenizer_loader) == 1
    assert "cannot read a model id" in capsys.readouterr().err
    assert main([*base, "--model", "m"], tokenizer_loader=_tokenizer_loader) == 1
    assert "warm-up request 1 failed" in capsys.readouterr().err
    assert main([*base, "--request-rate", "0"], tokenizer_loader=_tokenizer_loader) == 2
    assert "request_rate" in capsys.readouterr().err
    assert main([*base, "--dataset", "sharegpt"], tokenizer_loader=_tokenizer_loader) == 2
    assert "--dataset-path" in capsys.readouterr().err


@pytest.mark.slow  # two timed runs and a matplotlib figure
def test_compare_and_plot_two_runs(
    make_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fast, slow = make_server(itl=0.01), make_server(itl=0.15)
    assert _run(fast, tmp_path, "--label", "fast", name="a")[0] == 0
    assert _run(slow, tmp_path, "--label", "slow", name="b")[0] == 0
    capsys.readouterr()
    plot = tmp_path / "both.png"
    assert main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    header, *rows = table.splitlines()
    assert "fast" in header and "slow" in header and "B/A" in header
    cells = {row.split()[0]: row.split() for row in rows if row.strip("-")}
    assert cells["completed"][1:] == ["8", "8", "1.000"]
    # Each cell is the saved run's number and the last column their ratio (timing-free: a loaded machine
    # can stall either run's client, so which one is faster is not asserted).
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b"))
    for key in ("mean_itl_ms", "p99_e2el_ms", "output_throughput"):
        assert cells[key][1:3] == [f"{a[key]:.2f}", f"{b[key]:.2f}"]
        assert float(cells[key][3]) == pytest.approx(b[key] / a[key], abs=5e-4)
    # The slow server's last token leaves 50 + 4 * 150 ms after the request: a firm floor per request.
    assert all(ttft + sum(itls) >= 0.65 for ttft, itls in zip(b["ttfts"], b["itls"], strict=True))
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "missing.json")]) == 2


# ----------------------------------------------------------------------------------------------- client parts


def test_arrival_offsets() -> None:
    assert arrival_offsets(5, float("inf"), 1.0, seed=0) == [0.0] * 5
    poisson = arrival_offsets(4001, 10.0, 1.0, seed=0)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert poisson[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.1, rel=0.06)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(1.0, rel=0.1)  # exponential gaps
    smooth = arrival_offsets(4001, 10.0, 16.0, seed=0)
    sgaps = [b - a for a, b in zip(smooth, smooth[1:], strict=False)]
    smean = sum(sgaps) / len(sgaps)
    scv = (sum((g - smean) ** 2 for g in sgaps) / len(sgaps)) ** 0.5 / smean
    assert smean == pytest.approx(0.1, rel=0.06) and scv == pytest.approx(0.25, rel=0.15)  # 1/sqrt(16)
    assert arrival_offsets(10, 3.0, 1.0, seed=7) == arrival_offsets(10, 3.0, 1.0, seed=7)


def test_sse_parsing_and_payloads() -> None:
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(": keep-alive") is None and sse_data("event: x") is None and sse_data("") is None
    assert chunk_content({"text": "hi"}, is_chat=False) == "hi"
    assert chunk_content({"text": None}, is_chat=False) == ""
    assert chunk_content({"delta": {"role": "assistant"}}, is_chat=True) == ""
    assert chunk_content({"delta": {"content": "yo"}}, is_chat=True) == "yo"
    assert chunk_content({"delta": {"reasoning_content": "hm"}}, is_chat=True) == "hm"
    config = BenchConfig(extra_body={"top_k": 1}, ignore_eos=True)
    payload = build_payload(config, "m", SampleRequest("p", 1, 7))
    assert payload == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 7,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "top_k": 1,
    }
    for bad in (
        {"endpoint": "/v1/embeddings"},
        {"num_prompts": 0},
        {"max_concurrency": 0},
        {"burstiness": 0.0},
        {"timeout": float("inf")},
        {"base_url": "localhost:8000"},
    ):
        with pytest.raises(ValueError):
            BenchConfig(**bad)


# ----------------------------------------------------------------------------------------------- workloads


def test_special_ids_are_found_without_being_declared() -> None:
    assert special_token_ids(MergingTokenizer()) == {0, 1}


def test_random_prompts_have_exact_lengths_and_no_special_tokens() -> None:
    tok = MergingTokenizer()
    requests = sample_random_requests(
        tok, num_prompts=30, input_len=40, output_len=10, range_ratio=0.5, seed=3
    )
    assert len(requests) == 30
    for r in requests:
        ids = tok.encode(r.prompt)
        assert len(ids) == r.prompt_len  # exact, though decode -> encode merges bigrams
        assert 20 <= r.prompt_len <= 60 and 5 <= r.expected_output_len <= 15
        assert 0 not in ids and 1 not in ids and "<s>" not in r.prompt
    assert len({r.prompt_len for r in requests}) > 5
    again = sample_random_requests(tok, num_prompts=30, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    assert again == requests
    other = sample_random_requests(tok, num_prompts=30, input_len=40, output_len=10, range_ratio=0.5, seed=4)
    assert other != requests
    fixed = sample_random_requests(tok, num_prompts=5, input_len=16, output_len=3)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(16, 3)] * 5
    with pytest.raises(ValueError, match="range_ratio"):
        sample_random_requests(tok, 1, 8, 8, range_ratio=1.0)


@pytest.mark.slow  # the default model's tokenizer, read from its GGUF
def test_random_prompts_are_exact_under_the_served_model_tokenizer() -> None:
    # The real byte-level BPE (SmolLM2's, from the GGUF): merges across token boundaries are common.
    from engine.loader.model_loader import load_tokenizer

    tok = load_tokenizer("default")
    specials = special_token_ids(tok)
    assert {0, 1, 2}.issubset(specials)  # <|endoftext|>, <|im_start|>, <|im_end|>
    requests = sample_random_requests(tok, num_prompts=8, input_len=200, output_len=16, seed=0)
    for r in requests:
        ids = tok.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len == 200
        assert not specials.intersection(ids)


def test_prefix_repetition_shares_few_prefixes() -> None:
    tok = MergingTokenizer()
    requests = sample_prefix_repetition_requests(
        tok, num_prompts=10, prefix_len=30, suffix_len=8, num_prefixes=3, output_len=4, seed=1
    )
    assert len(requests) == 10
    heads: dict[str, int] = {}
    for r in requests:
        heads[r.prompt[:12]] = heads.get(r.prompt[:12], 0) + 1
        assert r.expected_output_len == 4
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert 30 + 8 - 2 <= r.prompt_len <= 30 + 8  # merges across the prefix/suffix seam only
    assert sorted(heads.values()) == [3, 3, 4]  # prompt i uses prefix i mod 3
    assert len({r.prompt for r in requests}) == 10  # every suffix differs


def test_sharegpt_filters_and_measures_reply_length(tmp_path: Path) -> None:
    tok = MergingTokenizer()
    long_prompt = "a" * 1100  # 1100 tokens > 1024
    data = [
        {
            "id": "ok1",
            "conversations": [
                {"from": "human", "value": "the cat sat"},
                {"from": "gpt", "value": "and then it ran away"},
            ],
        },
        {
            "id": "ok2",
            "conversations": [
                {"from": "system", "value": "be kind"},
                {"from": "human", "value": "hello there friend"},
                {"from": "gpt", "value": "hi hi hi hi"},
            ],
        },
        {
            "id": "short_prompt",
            "conversations": [
                {"from": "human", "value": "ab"},
                {"from": "gpt", "value": "long enough reply"},
            ],
        },
        {
            "id": "short_reply",
            "conversations": [
                {"from": "human", "value": "long enough prompt"},
                {"from": "gpt", "value": "no"},
            ],
        },
        {
            "id": "too_long",
            "conversations": [
                {"from": "human", "value": long_prompt},
                {"from": "gpt", "value": "fine reply here"},
            ],
        },
        {"id": "no_reply", "conversations": [{"from": "human", "value": "anyone here at all"}]},
        {"id": "not_a_list", "conversations": "oops"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sample_sharegpt_requests(tok, path, num_prompts=2, seed=0)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {"the cat sat", "hello there friend"}
    assert by_prompt["the cat sat"].expected_output_len == len(tok.encode("and then it ran away"))
    assert by_prompt["hello there friend"].prompt_len == len(tok.encode("hello there friend"))
    # More prompts than valid pairs: drawn again; a fixed output length also admits the short reply.
    assert len(sample_sharegpt_requests(tok, path, num_prompts=5, seed=0)) == 5
    fixed = sample_sharegpt_requests(tok, path, num_prompts=3, output_len=7, seed=0)
    assert {r.prompt for r in fixed} == {"the cat sat", "hello there friend", "long enough prompt"}
    assert all(r.expected_output_len == 7 for r in fixed)
    with pytest.raises(ValueError, match="cannot read"):
        sample_sharegpt_requests(tok, tmp_path / "missing.json", num_prompts=1)
