"""The ``cbserve`` command: ``cbserve serve [flags]`` runs the server, ``cbserve bench ...`` the serving
benchmark (``bench.serving.main``).

Every ``serve`` flag can also come from the environment as ``CBSERVE_<FLAG>`` (upper case, dashes as
underscores: ``--max-num-seqs`` is ``CBSERVE_MAX_NUM_SEQS``); the command line wins. Boolean flags take
1/true/yes/on or 0/false/no/off from the environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from server.config import DEFAULT_GRAMMAR_TIMEOUT_S, REASONING_PARSERS, TOOL_CALL_PARSERS, parse_bytes

ENV_PREFIX = "CBSERVE_"


logger = logging.getLogger("cbserve")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _watermark(text: str) -> Any:
    """``--watermarking-config``: a JSON object of transformers' WatermarkingConfig or
    SynthIDTextWatermarkingConfig fields, validated before the model loads."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    # NOTE: imported here so that `cbserve --help` does not pay for torch.
    from engine.generation.errors import GenerationConfigError
    from engine.generation.watermark_config import watermarking_config_from

    try:
        return watermarking_config_from(value)
    except GenerationConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _speculative_config(text: str) -> Any:
    """``--speculative-config``: vLLM's JSON object (engine/speculative/config.py), checked before the model
    loads."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    # NOTE: imported here so that `cbserve --help` does not pay for torch.
    from engine.speculative.config import SpeculativeConfig, SpeculativeConfigError

    try:
        return SpeculativeConfig.from_dict(value)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_events_config(text: str) -> Any:
    """``--kv-events-config``: a JSON object of vLLM's KVEventsConfig fields (server/kv_events_config.py)."""
    from server.kv_events_config import KVEventsConfig, KVEventsConfigError

    try:
        return KVEventsConfig.from_json(text)
    except (KVEventsConfigError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _logits_processor(text: str) -> str:
    """``--logits-processors``: each spec must import before the model loads (it is built, with the
    model's tokenizer, once the model is loaded)."""
    # NOTE: imported here so that `cbserve --help` does not pay for torch.
    from engine.generation.processor_plugins import ProcessorLoadError, resolve_logits_processor

    try:
        resolve_logits_processor(text)
    except ProcessorLoadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _origins(text: str) -> list[str]:
    return [o.strip() for o in text.split(",") if o.strip()]


def _env_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _add_model_flags(serve: argparse.ArgumentParser) -> None:
    """The flags that say which model to load and how it runs."""
    a = serve.add_argument
    a(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct GGUF), a HF folder or a .gguf file",
    )
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    a("--load-format", choices=["auto", "gguf", "safetensors", "dummy"], default="auto")
    a(
        "--model-impl",
        choices=["auto", "native", "transformers"],
        default="auto",
        help="native (cbserve's Llama/Mistral/Qwen2/Qwen3 code), transformers (any decoder-only causal LM "
        "through transformers' modeling code), or auto (native where it implements the architecture)",
    )
    a(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="insist that a request's tokens and logprobs do not depend on what shares its batch (float32 "
        "matmuls of every size on cbserve's kernel; bfloat16 without AMX in float32 there; on CUDA, Triton kernels); refuses to "
        "start where it cannot",
    )
    a(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over this many processes (one rank each, started by cbserve; gloo on CPU, "
        "NCCL on CUDA); it must divide the model's attention and KV heads",
    )
    a(
        "--attention-backend",
        choices=["auto", "cpu", "triton", "sdpa"],
        default="auto",
        help="decode attention: the CPU C kernel, the GPU Triton kernel, PyTorch SDPA, or auto (the device's "
        "kernel where it runs)",
    )


def _add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """The flags of ``cbserve serve`` (docs/SERVER.md lists them with their meaning)."""
    a = serve.add_argument
    _add_model_flags(serve)
    a("--host", default="127.0.0.1")
    a("--port", type=_port, default=8000)
    a("--scheduler", choices=["fifo", "prefill_first"], default="fifo")
    a("--max-batch-tokens", type=_positive_int, default=2048, help="tokens computed per engine step, at most")
    a("--max-num-seqs", type=_positive_int, default=64, help="sequences running at once, at most")
    mixed = "prompt tokens in a step that also decodes (default: --max-batch-tokens)"
    a("--max-mixed-prefill-tokens", type=_positive_int, default=None, help=mixed)
    burst = "an idle engine given requests starts once none has come for this long (ms)"
    a("--arrival-window-ms", type=_non_negative_float, default=3.0, help=burst)
    a("--block-size", type=_positive_int, default=16, help="tokens per KV-cache block")
    a("--kv-cache-memory", type=parse_bytes, default=None, help="KV-cache size in bytes (2GiB, 512MiB, ...)")
    a("--num-blocks", type=_positive_int, default=None, help="KV-cache size in blocks (instead of bytes)")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    a(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CUDA: run every step eagerly (no CUDA graphs of the decode step)",
    )
    a("--api-key", default=None, help="require 'Authorization: Bearer <key>' (also CBSERVE_API_KEY)")
    a("--served-model-name", default=None, help="the model name clients use (default: the model's name)")
    a("--max-queue", type=_positive_int, default=256, help="waiting requests before 429")
    a("--max-model-len", type=_positive_int, default=None, help="context length limit (default: the model's)")
    a("--shutdown-timeout", type=_non_negative_float, default=30.0, help="seconds to drain on SIGTERM")
    a(
        "--grammar-compile-timeout",
        type=_non_negative_float,
        default=DEFAULT_GRAMMAR_TIMEOUT_S,
        help="seconds a structured output's grammar may take to compile before a 400 (too complex)",
    )
    a("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    a(
        "--cors-origins",
        type=_origins,
        default=None,
        help="comma-separated allowed origins (CORS off if unset)",
    )
    a("--max-body-bytes", type=parse_bytes, default=16 * 1024 * 1024, help="request body size limit")
    a(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        default="auto",
        help="split <think>...</think> into reasoning_content: auto (when the tokenizer has those tokens), "
        "think/qwen3/deepseek_r1 (always) or none",
    )
    a(
        "--tool-call-parser",
        choices=list(TOOL_CALL_PARSERS),
        default="auto",
        help="the tool-call syntax parsed for tool_choice auto: auto (from the chat template), hermes, "
        "llama3_json or mistral",
    )
    _add_generation_flags(serve)
    _add_gateway_flags(serve)


def _add_gateway_flags(serve: argparse.ArgumentParser) -> None:
    """The flags for a replica behind a KV-aware gateway."""
    serve.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help="publish the prefix cache's changes for KV-aware routers, as vLLM does: a JSON object such as "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}\' '
        "(fields: replay_endpoint, buffer_steps, hwm too; docs/DEPLOY.md)",
    )


def _add_generation_flags(serve: argparse.ArgumentParser) -> None:
    """The flags that change how every request generates."""
    a = serve.add_argument
    a(
        "--watermarking-config",
        type=_watermark,
        default=None,
        help="watermark every request that names none, and detect it by default: a JSON object of "
        'WatermarkingConfig fields (\'{"bias": 2.0, "seeding_scheme": "selfhash"}\') or of '
        'SynthIDTextWatermarkingConfig fields (\'{"ngram_len": 5, "keys": [654, 400, 836]}\')',
    )
    a(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help="speculative decoding for every request, as vLLM spells it: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' (prompt lookup); a request '
        "may also ask for prompt lookup alone with prompt_lookup_num_tokens",
    )
    a(
        "--logits-processors",
        nargs="+",
        type=_logits_processor,
        default=None,
        metavar="SPEC",
        help="logits processors for the requests with logits_processor_args: package.module:Class or an entry "
        "point name of the group cbserve.logits_processors, each built with (tokenizer, vocab_size) and "
        "called with (rows, logits); refuses to start when one cannot be loaded (docs/GENERATION.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cbserve", description="A continuous-batching LLM inference server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible server. Every flag also reads CBSERVE_<FLAG> from the environment.",
    )
    _add_serve_flags(serve)
    serve.set_defaults(handler=_serve)
    bench = sub.add_parser(
        "bench", help="run the serving benchmark (arguments go to bench.serving)", add_help=False
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=_bench)
    return parser


def apply_env_defaults(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Set the ``serve`` flags' defaults from ``CBSERVE_*`` variables (so the command line still wins)."""
    serve = _subparser(parser, "serve")
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = ENV_PREFIX + action.dest.upper()
        if name not in env:
            continue
        raw = env[name]
        convert: Callable[[str], Any]
        if action.nargs == "+":
            convert = _env_list(action.type or str)  # type: ignore[arg-type]
        elif isinstance(action, argparse.BooleanOptionalAction):
            convert = _env_bool
        elif action.type is not None:
            convert = action.type  # type: ignore[assignment]
        else:
            convert = str
        try:
            value = convert(raw)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            serve.error(f"environment variable {name}: {exc}")
        if action.choices is not None and value not in action.choices:
            serve.error(
                f"environment variable {name}: {raw!r} is not one of {', '.join(map(str, action.choices))}"
            )
        serve.set_defaults(**{action.dest: value})


def _env_list(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A many-valued flag from the environment: its values separated by commas or spaces."""
    return lambda raw: [convert(part) for part in raw.replace(",", " ").split()]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.kv_cache_memory is not None and args.num_blocks is not None:
        logger.error("give --kv-cache-memory or --num-blocks, not both")
        return 2
    # NOTE: imported here so that `cbserve --help` and `cbserve bench` do not pay for torch.
    from engine.executor.parallel.torchrun import exit_if_torchrun_rank
    from server.app import build_app
    from server.config import ServerConfig, ServerConfigError
    from server.kv_events_config import KVEventsConfig
    from server.lifecycle import DrainingServer, uvicorn_config

    engine = _load_engine(args)
    if engine is None:
        return 2
    try:
        config = ServerConfig(
            served_model_name=args.served_model_name or engine.model_name,
            api_key=args.api_key or None,
            max_body_bytes=args.max_body_bytes,
            cors_origins=tuple(args.cors_origins or ()),
            shutdown_timeout=args.shutdown_timeout,
            max_queue=args.max_queue,
            grammar_compile_timeout=args.grammar_compile_timeout,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            watermarking_config=args.watermarking_config,
            kv_events=args.kv_events_config or KVEventsConfig(),
        )
    except ServerConfigError as exc:
        logger.error("%s", exc)
        return 2
    app = build_app(engine, config)
    _log_serving(engine, config.served_model_name, args.host, args.port)
    server = DrainingServer(uvicorn_config(app, args.host, args.port, args.log_level), app.state.server)
    try:
        server.run()
    finally:
        engine.close()
    code = 0 if server.started and not app.state.server.failed else 1
    exit_if_torchrun_rank(code)  # NOTE: rank 0 of a torchrun job ends as its other ranks do
    return code


def _load_engine(args: argparse.Namespace) -> Any:
    """The model with its logits processors, or None once the reason it cannot be served is logged."""
    from engine.engine import Engine

    try:
        engine = Engine.from_pretrained(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            load_format=args.load_format,
            model_impl=args.model_impl,
            batch_invariant=args.batch_invariant,
            speculative_config=args.speculative_config,
            tensor_parallel_size=args.tensor_parallel_size,
            attention_backend=args.attention_backend,
            scheduler=args.scheduler,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            max_mixed_prefill_tokens=args.max_mixed_prefill_tokens,
            arrival_window_ms=args.arrival_window_ms,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            num_blocks=args.num_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
        )
    except (OSError, ValueError) as exc:
        logger.error("could not load model %r: %s", args.model, exc)
        return None
    try:
        engine.load_logits_processors(args.logits_processors or [])
    except ValueError as exc:
        logger.error("could not load the logits processors: %s", exc)
        return None
    return engine


def _log_serving(engine: Any, served_model_name: str, host: str, port: int) -> None:
    """One line that says what is served where, with the KV cache's capacity."""
    capacity = engine.num_blocks * engine.block_size
    logger.info(
        "model %s on %s (%s, %s decode attention); KV cache %d blocks x %d = %d tokens, %.2f sequences at "
        "full context (%d); serving '%s' at http://%s:%d",
        engine.model_name,
        engine.device,
        str(engine.dtype).removeprefix("torch."),
        engine.attention_backend,
        engine.num_blocks,
        engine.block_size,
        capacity,
        capacity / engine.max_model_len,
        engine.max_model_len,
        served_model_name,
        host,
        port,
    )


def _bench(args: argparse.Namespace) -> int:
    from bench.serving import main as bench_main

    result = bench_main(list(args.bench_args))
    return int(result) if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        # NOTE: forwarded verbatim (argparse would claim -h and options it does not know).
        return _bench(argparse.Namespace(bench_args=argv[1:]))
    parser = build_parser()
    apply_env_defaults(parser, os.environ)
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
