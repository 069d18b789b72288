"""The `cbserve` argument parsing (no model load): sizes with suffixes, every flag from CBSERVE_<FLAG>,
the command line winning, clear errors, `cbserve bench` forwarding its argv."""

from __future__ import annotations

import argparse
import os
import sys
import types
from typing import Any

import pytest

from cli.main import _subparser, apply_env_defaults, build_parser, main
from engine.generation.watermark_config import GreenlistWatermark, SynthIDWatermark
from engine.speculative.config import SpeculativeConfig
from server.config import parse_bytes
from server.kv_events_config import KVEventsConfig


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    apply_env_defaults(parser, env or {})
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("4GB", 4 * 10**9),
        ("1.5 KiB", 1536),
        ("3k", 3000),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "-1", "0", "1e9"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_defaults() -> None:
    args = parse(["serve"])
    assert (args.model, args.host, args.port, args.device, args.dtype) == (
        "default",
        "127.0.0.1",
        8000,
        "auto",
        "auto",
    )
    assert args.enable_prefix_caching is True and args.enforce_eager is False and args.model_impl == "auto"
    assert args.api_key is None and args.cors_origins is None and args.kv_cache_memory is None


def test_every_flag_reads_the_environment() -> None:
    env = {
        "CBSERVE_MODEL": "/models/x.gguf",
        "CBSERVE_HOST": "0.0.0.0",
        "CBSERVE_PORT": "9001",
        "CBSERVE_DEVICE": "cuda",
        "CBSERVE_DTYPE": "bfloat16",
        "CBSERVE_LOAD_FORMAT": "gguf",
        "CBSERVE_MODEL_IMPL": "transformers",
        "CBSERVE_BATCH_INVARIANT": "true",
        "CBSERVE_TENSOR_PARALLEL_SIZE": "2",
        "CBSERVE_ATTENTION_BACKEND": "sdpa",
        "CBSERVE_SCHEDULER": "prefill_first",
        "CBSERVE_MAX_BATCH_TOKENS": "4096",
        "CBSERVE_MAX_NUM_SEQS": "8",
        "CBSERVE_MAX_MIXED_PREFILL_TOKENS": "256",
        "CBSERVE_ARRIVAL_WINDOW_MS": "1.5",
        "CBSERVE_BLOCK_SIZE": "32",
        "CBSERVE_KV_CACHE_MEMORY": "2GiB",
        "CBSERVE_NUM_BLOCKS": "100",
        "CBSERVE_ENABLE_PREFIX_CACHING": "false",
        "CBSERVE_ENFORCE_EAGER": "true",
        "CBSERVE_API_KEY": "k",
        "CBSERVE_SERVED_MODEL_NAME": "m",
        "CBSERVE_MAX_QUEUE": "7",
        "CBSERVE_MAX_MODEL_LEN": "1024",
        "CBSERVE_SHUTDOWN_TIMEOUT": "2.5",
        "CBSERVE_GRAMMAR_COMPILE_TIMEOUT": "4.5",
        "CBSERVE_LOG_LEVEL": "debug",
        "CBSERVE_CORS_ORIGINS": "http://a.example, http://b.example",
        "CBSERVE_MAX_BODY_BYTES": "1MiB",
        "CBSERVE_REASONING_PARSER": "none",
        "CBSERVE_TOOL_CALL_PARSER": "mistral",
        "CBSERVE_WATERMARKING_CONFIG": '{"bias": 3, "seeding_scheme": "selfhash"}',
        "CBSERVE_LOGITS_PROCESSORS": "user_processor_fixtures:BanToken, user_processor_fixtures:WrongShape",
        "CBSERVE_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 5}',
        "CBSERVE_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}',
    }
    args = parse(["serve"], env)
    assert args.model == "/models/x.gguf" and args.host == "0.0.0.0" and args.port == 9001
    assert (args.device, args.dtype, args.load_format, args.scheduler) == (
        "cuda",
        "bfloat16",
        "gguf",
        "prefill_first",
    )
    assert args.attention_backend == "sdpa" and args.model_impl == "transformers"
    assert args.batch_invariant is True and args.tensor_parallel_size == 2
    assert (args.max_batch_tokens, args.max_num_seqs, args.block_size) == (4096, 8, 32)
    assert args.max_mixed_prefill_tokens == 256 and args.arrival_window_ms == 1.5
    assert args.kv_cache_memory == 2 << 30 and args.num_blocks == 100
    assert args.enable_prefix_caching is False
    assert args.enforce_eager is True
    assert (args.api_key, args.served_model_name, args.max_queue, args.max_model_len) == ("k", "m", 7, 1024)
    assert args.shutdown_timeout == 2.5 and args.log_level == "debug"
    assert args.grammar_compile_timeout == 4.5
    assert args.cors_origins == ["http://a.example", "http://b.example"]
    assert args.max_body_bytes == 1 << 20 and args.reasoning_parser == "none"
    assert args.tool_call_parser == "mistral"
    assert args.watermarking_config == GreenlistWatermark(bias=3.0, seeding_scheme="selfhash")
    assert args.logits_processors == [
        "user_processor_fixtures:BanToken",
        "user_processor_fixtures:WrongShape",
    ]
    assert args.speculative_config == SpeculativeConfig("ngram", num_speculative_tokens=5)
    assert args.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv")
    # every serve flag has its variable in this test
    serve_flags = {a.dest for a in _subparser(build_parser(), "serve")._actions}
    assert {f"CBSERVE_{d.upper()}" for d in serve_flags - {"help", "handler"}} == set(env)


def test_command_line_wins_over_environment() -> None:
    env = {"CBSERVE_PORT": "9001", "CBSERVE_ENABLE_PREFIX_CACHING": "0", "CBSERVE_API_KEY": "from-env"}
    args = parse(["serve", "--port", "9002", "--enable-prefix-caching", "--api-key", "from-cli"], env)
    assert args.port == 9002 and args.enable_prefix_caching is True and args.api_key == "from-cli"


@pytest.mark.parametrize(
    "env", [{"CBSERVE_PORT": "eighty"}, {"CBSERVE_DEVICE": "tpu"}, {"CBSERVE_ENABLE_PREFIX_CACHING": "maybe"}]
)
def test_bad_environment_value_is_a_clear_error(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["serve"], env)
    assert exc.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


def test_bad_flag_value_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["serve", "--max-num-seqs", "0"])
    assert exc.value.code == 2


def test_watermarking_config_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["serve", "--watermarking-config", '{"ngram_len": 5, "keys": [654, 400]}'])
    assert args.watermarking_config == SynthIDWatermark(ngram_len=5, keys=(654, 400))
    assert parse(["serve"]).watermarking_config is None
    for bad, why in (
        ("[1, 2]", "expected a JSON object"),
        ("{bias: 2}", "expected a JSON object"),
        ('{"greenlist_ratio": 1.5}', "watermarking_config.greenlist_ratio: must be in (0, 1)"),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(["serve", "--watermarking-config", bad])
        assert exc.value.code == 2
        assert why in capsys.readouterr().err


def test_speculative_config_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["serve", "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 4}'])
    assert args.speculative_config == SpeculativeConfig("ngram", prompt_lookup_max=4)
    assert parse(["serve"]).speculative_config is None
    for bad, why in (
        ("[1]", "must be a JSON object"),
        ("{method: ngram}", "expected a JSON object"),
        ('{"method": "medusa"}', "unknown speculative method 'medusa'"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be an integer"),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(["serve", "--speculative-config", bad])
        assert exc.value.code == 2
        assert why in capsys.readouterr().err


def test_kv_events_config_flag(capsys: pytest.CaptureFixture[str]) -> None:
    text = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
    assert parse(["serve", "--kv-events-config", text]).kv_events_config.publishes
    assert parse(["serve"]).kv_events_config is None
    for bad, why in (
        ("[1]", "expected a JSON object"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be a bool"),
        ('{"publisher": "nats"}', "publisher must be one of zmq, null"),
        ('{"endpoint": "localhost:5557"}', "endpoint must be a tcp://, ipc:// or inproc:// address"),
        ('{"buffer_steps": 0}', "buffer_steps must be a positive integer"),
        ('{"max_queue": 5}', "unknown field(s) max_queue"),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(["serve", "--kv-events-config", bad])
        assert exc.value.code == 2
        assert why in capsys.readouterr().err


def test_logits_processors_flag(capsys: pytest.CaptureFixture[str]) -> None:
    specs = ["user_processor_fixtures:BanToken", "user_processor_fixtures:WrongShape"]
    assert parse(["serve", "--logits-processors", *specs]).logits_processors == specs
    assert parse(["serve"]).logits_processors is None
    for bad, why in (
        ("no_such_module_anywhere:Thing", "cannot import 'no_such_module_anywhere'"),
        ("user_processor_fixtures:Missing", "has no attribute 'Missing'"),
        ("no-such-entry-point", "no entry point of that name"),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(["serve", "--logits-processors", bad])
        assert exc.value.code == 2
        assert why in capsys.readouterr().err


def test_serve_refuses_to_start_when_a_processor_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The spec imports (the command line passes it) but its class cannot be built with the model's
    tokenizer: ``serve`` logs why and exits 2 before serving."""
    from engine.engine import Engine
    from engine.generation.processor_plugins import load_logits_processors

    for name in [k for k in os.environ if k.startswith("CBSERVE_")]:
        monkeypatch.delenv(name)

    class NoModel:
        """The part of a loaded ``Engine`` that ``serve`` uses before it serves."""

        def load_logits_processors(self, specs: list[str]) -> None:
            load_logits_processors(specs, None, 16)

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda **kwargs: NoModel()))
    for spec, why in (
        ("user_processor_fixtures:FailsToBuild", "FailsToBuild(tokenizer, vocab_size) failed"),
        ("user_processor_fixtures:TakesOnlyLogits", "must take (rows, logits)"),
    ):
        caplog.clear()
        assert main(["serve", "--logits-processors", spec]) == 2
        assert why in caplog.text


def test_kv_cache_memory_and_num_blocks_are_exclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("CBSERVE_")]:
        monkeypatch.delenv(name)
    assert main(["serve", "--kv-cache-memory", "1GiB", "--num-blocks", "10"]) == 2


def test_bench_forwards_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_main(argv: list[str]) -> int:
        seen["argv"] = argv
        return 3

    monkeypatch.setitem(sys.modules, "bench.serving", types.SimpleNamespace(main=fake_main))
    assert main(["bench", "--base-url", "http://x", "-h"]) == 3
    assert seen["argv"] == ["--base-url", "http://x", "-h"]


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_arrival_window_must_be_a_finite_number_of_ms_at_least_zero(value: str) -> None:
    with pytest.raises(SystemExit):
        parse(["serve", "--arrival-window-ms", value])
    assert parse(["serve", "--arrival-window-ms", "0"]).arrival_window_ms == 0.0
    assert parse(["serve"]).arrival_window_ms == 3.0
