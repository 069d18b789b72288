"""The Python API: ``Engine.from_pretrained(...)``, ``generate_batch``, ``init_continuous_batching``."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from engine.cpu.allocator import keep_freed_memory, release_freed_memory
from engine.cpu.openmp_pools import on_scratch_thread
from engine.executor.attention.backend import select_decode_kernel
from engine.executor.cuda_graphs import CudaGraphDecoder
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.dola import LayerContrast
from engine.executor.draft_model import DraftModel
from engine.executor.kv_cache import KVCache
from engine.executor.parallel.runner import TensorParallelRunner
from engine.executor.parallel.sharded_llama import ShardedLlamaForCausalLM
from engine.executor.parallel.sharded_transformers import ShardedTransformersForCausalLM
from engine.executor.runner import ModelRunner
from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.processor_plugins import load_logits_processors
from engine.generation.sampler import Sampler
from engine.generation.user_processors import (
    BatchedLogitsProcessor,
    TransformersCriterion,
    TransformersProcessor,
)
from engine.generation.watermark_config import watermarking_config_from
from engine.generation.watermark_detect import DEFAULT_Z_THRESHOLD, WatermarkDetection, detect_watermark
from engine.grammar_workers import DEFAULT_COMPILE_TIMEOUT_S
from engine.loader.model_loader import LoadedModel, load_model
from engine.manager import ContinuousBatchingManager
from engine.outputs import GenerationOutput
from engine.speculative.config import SpeculativeConfig
from kvcache.sizing import num_blocks_for_budget
from scheduler import make_scheduler
from scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85


@dataclass(frozen=True)
class CacheOptions:
    """How big the KV cache is and how the scheduler fills it."""

    scheduler: str = "fifo"
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    safety_margin: float = 0.2
    max_mixed_prefill_tokens: int | None = (
        None  # prompt tokens in a step that also decodes (scheduler/config.py)
    )
    enforce_eager: bool = False  # CUDA: no graphs of the decode step (engine/executor/cuda_graphs.py)
    # requests reaching an idle engine: its first step waits until none has come for this long
    # (engine/loop.py's _gather_arrivals); 0: it starts on the first it sees
    arrival_window_ms: float = 3.0


class Engine:
    """A loaded model with its KV cache; hands out one continuous-batching manager."""

    speculative_config: SpeculativeConfig | None = None  # how every request speculates (from_pretrained)
    _draft_models: dict[tuple[str, str], DraftModel]  # by (model, load_format), loaded on first use

    def __init__(
        self, loaded: LoadedModel, options: CacheOptions, model_name: str, attention_backend: str = "auto"
    ) -> None:
        self.loaded = loaded
        self.options = options
        self.model_name = model_name
        self.model_config = loaded.config
        if loaded.tokenizer is None:
            raise ValueError(f"model {model_name!r} has no tokenizer: cbserve needs one to serve text")
        self.tokenizer = loaded.tokenizer
        # NOTE: a dummy model may borrow a tokenizer that spells fewer ids than its embedding has rows (a dummy
        # Llama-3-8B with SmolLM2's 49,152 tokens): it generates only ids the tokenizer can spell, so that
        # clients and benchmarks get text. Real checkpoints sample their whole vocabulary, as transformers does.
        self.vocab_size = loaded.config.vocab_size
        if loaded.source.kind == "dummy":
            self.vocab_size = min(self.vocab_size, self.tokenizer.vocab_size)
        self.model = loaded.model
        param = next(self.model.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.generation_defaults = GenerationConfig.from_model_defaults(loaded.generation_defaults)
        limit = loaded.config.max_position_embeddings
        self.max_model_len = min(limit, options.max_model_len) if options.max_model_len else limit
        self.block_size = options.block_size
        self.num_blocks = self._num_blocks()
        self.kv_cache = KVCache(
            num_layers=loaded.config.num_hidden_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=loaded.config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        cfg = loaded.config
        self.decode_kernel = select_decode_kernel(
            attention_backend, self.device, self.dtype, cfg.head_dim, self.block_size, cfg.num_queries_per_kv,
            cfg.attn_logit_softcapping, loaded.batch_invariant,
        )  # fmt: skip
        self.attention_backend = self.decode_kernel.name if self.decode_kernel is not None else "sdpa"
        # a row's logits are the same bits whatever else shares its step: matmul kernels with one path per
        # row (LoadedModel.batch_invariant) and attention kernels whose reductions run per query
        self.batch_invariant = loaded.batch_invariant and getattr(self.decode_kernel, "batch_invariant", False)
        self.cuda_graphs: CudaGraphDecoder | None = None
        # NOTE: the transformers backend says False: its forward runs eagerly
        graphs = getattr(self.model, "supports_cuda_graphs", True) and not options.enforce_eager
        if self.device.type == "cuda" and self.decode_kernel is not None and graphs:
            self.cuda_graphs = CudaGraphDecoder(
                self.model,
                self.kv_cache,
                self.decode_kernel,
                self.block_size,
                self.max_model_len,
                options.max_num_seqs,
                self.device,
            )
        self.decode_stack = CpuDecodeStack.for_model(self.model)  # None: no stack (float32; bf16 on AMX)
        self.logits_processors: list[tuple[str, BatchedLogitsProcessor]] = []  # load_logits_processors
        self._manager: ContinuousBatchingManager | None = None
        self._draft_models = {}

    @classmethod
    def from_pretrained(
        cls,
        model: str = "default",
        device: str = "auto",
        dtype: str = "auto",
        load_format: str = "auto",
        served_model_name: str | None = None,
        attention_backend: str = "auto",
        prepack_weights: bool = True,
        model_impl: str = "auto",
        batch_invariant: bool = False,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        **cache_and_scheduler_options: Any,
    ) -> Engine:
        """Load ``model`` ("default", a HF folder, a .gguf file, or a dummy preset with
        ``load_format="dummy"``) and size its KV cache. Options: see ``CacheOptions``;
        ``attention_backend``: auto, cpu, triton or sdpa (engine/executor/attention/backend.py); ``prepack_weights``: CPU
        matmuls on prepacked oneDNN weights (engine/executor/kernels/prepacked.py); ``model_impl``: auto, native or
        transformers (engine/executor/models/registry.py); ``batch_invariant``: insist that a request's logits
        do not depend on its batch (``ValueError`` where the kernels cannot promise it; ``Engine.batch_invariant``
        says whether the chosen kernels promise it anyway: docs/GENERATION.md); ``speculative_config``: how
        every request speculates (vLLM's dict: engine/speculative/config.py; ``SpeculativeConfigError``, a
        ``ValueError``, when it cannot be used); ``tensor_parallel_size``: the model in that many shards, one
        process per rank started here (engine/loader/shards.py; ``close`` stops them)."""
        speculation = _speculative_config(speculative_config)
        options = CacheOptions(**{k: v for k, v in cache_and_scheduler_options.items() if v is not None})
        keep_freed_memory()

        def build() -> Engine:
            loaded = load_model(
                model,
                load_format=load_format,
                dtype=dtype,
                device=device,
                prepack=prepack_weights,
                model_impl=model_impl,
                batch_invariant=batch_invariant,
                tensor_parallel_size=tensor_parallel_size,
            )
            name = served_model_name or _default_model_name(model, loaded)
            engine = cls(loaded, options, name, attention_backend)
            engine.speculative_config = speculation
            engine._draft_model(speculation)  # NOTE: a draft model that cannot be used fails the start
            if batch_invariant and not engine.batch_invariant:
                raise ValueError(
                    "batch_invariant needs the cpu (or on CUDA the triton) attention backend, not "
                    f"{engine.attention_backend}"
                )
            release_freed_memory()  # the load's temporaries, which no step reuses
            return engine

        # NOTE: no OpenMP pool may outlive the set-up on this thread: it would slow every forward of the
        # manager's thread (engine/cpu/openmp_pools.py).
        return on_scratch_thread(build)

    # ------------------------------------------------------------------ KV cache sizing
    def _num_blocks(self) -> int:
        o = self.options
        if o.num_blocks is not None:
            return o.num_blocks
        cfg = self.model_config
        if o.kv_cache_memory is not None:
            budget = o.kv_cache_memory
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * o.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num = num_blocks_for_budget(
            budget,
            cfg.num_hidden_layers,
            self.num_kv_heads,
            cfg.head_dim,
            o.block_size,
            self.dtype.itemsize,
        )
        # NOTE: more blocks than every sequence at full context can use is memory for nothing.
        cap = o.max_num_seqs * -(-self.max_model_len // o.block_size)
        return min(num, cap)

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this process computes: one shard's under tensor parallelism (executor/parallel/)."""
        return int(getattr(self.model, "config", self.loaded.config).num_key_value_heads)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def close(self) -> None:
        """Release what outlives the engine's managers: a sharded model's other ranks (their processes)."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ user processors
    def load_logits_processors(self, specs: Sequence[str]) -> None:
        """Load the server's logits processors (``package.module:Class`` or an entry point name in the group
        ``cbserve.logits_processors``), built with this model's tokenizer and vocabulary size; they run
        for the requests with ``logits_processor_args`` in every manager made after this call. Raises
        ``ProcessorLoadError`` (a ``ValueError``) naming the spec that cannot be used, and why."""
        self.logits_processors = load_logits_processors(specs, self.tokenizer, self.vocab_size)

    # ------------------------------------------------------------------ continuous batching
    def init_continuous_batching(
        self,
        max_queue: int = 1024,
        grammar_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        enable_kv_cache_events: bool = False,
        **overrides: Any,
    ) -> ContinuousBatchingManager:
        """A manager over this engine's model and cache (not started). ``overrides`` may change the
        scheduler's options (``scheduler``, ``max_batch_tokens``, ``max_num_seqs``, ...);
        ``grammar_timeout_s`` bounds the wait for a structured output's grammar (engine/grammar_workers.py);
        ``speculative_config`` replaces the engine's for this manager;
        ``enable_kv_cache_events`` records the prefix cache's changes for ``add_kv_event_observer``."""
        o = self.options
        opts = {**o.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
        sched_config = SchedulerConfig(
            max_batch_tokens=opts["max_batch_tokens"],
            max_num_seqs=opts["max_num_seqs"],
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            safety_margin=opts["safety_margin"],
            max_mixed_prefill_tokens=opts["max_mixed_prefill_tokens"],
            enable_prefix_caching=opts["enable_prefix_caching"],
            max_model_len=self.max_model_len,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        scheduler = make_scheduler(opts["scheduler"], sched_config)
        speculation = _speculative_config(speculative_config) or self.speculative_config
        executor = self._runner(self._draft_model(speculation))
        eos = tuple(self.tokenizer.eos_token_ids) or tuple(self.model_config.eos_token_ids)
        sampler = Sampler(
            self.vocab_size, self.device, eos_token_ids=eos, logits_processors=self.logits_processors
        )
        self._manager = ContinuousBatchingManager(
            scheduler=scheduler,
            executor=executor,
            sampler=sampler,
            tokenizer=self.tokenizer,
            generation_defaults=self.generation_defaults,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=eos,
            max_queue=max_queue,
            grammar_timeout_s=grammar_timeout_s,
            layer_contrast=self._layer_contrast(),
            speculative_config=speculation,
        )
        self._manager.loop.arrival_window_s = opts["arrival_window_ms"] / 1000
        return self._manager

    def _runner(self, draft_model: DraftModel | None) -> ModelRunner:
        """The executor of a new manager: one process's, or rank 0's of a sharded model."""
        if isinstance(self.model, ShardedLlamaForCausalLM | ShardedTransformersForCausalLM):
            return TensorParallelRunner(
                self.model, self.kv_cache, self.block_size, self.device, self.decode_kernel, draft_model
            )
        return ModelRunner(
            self.model,
            self.kv_cache,
            self.block_size,
            self.device,
            self.decode_kernel,
            self.cuda_graphs,
            self.decode_stack,
            draft_model,
        )

    def _draft_model(self, speculation: SpeculativeConfig | None) -> DraftModel | None:
        """The draft model of a ``draft_model`` config, loaded once (as the target: its device and dtype, the
        native model) with a KV cache of the target's blocks. ``ValueError`` when its vocabulary differs."""
        if speculation is None or speculation.model is None:
            return None
        key = (speculation.model, speculation.load_format)
        if key not in self._draft_models:
            loaded = load_model(
                speculation.model, speculation.load_format, self.dtype, self.device, model_impl="native"
            )
            cfg = loaded.config
            if cfg.vocab_size != self.model_config.vocab_size:
                raise ValueError(
                    f"the draft model {speculation.model!r} has {cfg.vocab_size} tokens, the target "
                    f"{self.model_config.vocab_size}: a draft model needs the target's vocabulary"
                )
            cache = KVCache(
                cfg.num_hidden_layers, self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim,
                self.dtype, self.device,
            )  # fmt: skip
            self._draft_models[key] = DraftModel(loaded.model, cache, self.decode_kernel)
        return self._draft_models[key]

    def _layer_contrast(self) -> LayerContrast | None:
        """DoLa's view of the model, where its code gives its layers' logits (the native model does)."""
        if not getattr(self.model, "supports_early_exits", False):
            return None
        cfg = self.model_config
        return LayerContrast(cfg.num_hidden_layers, bool(getattr(cfg, "tie_word_embeddings", False)))

    def generate_batch(
        self,
        inputs: list[list[int]],
        generation_config: GenerationConfig | None = None,
        progress_bar: bool = True,
        record_timestamps: bool = False,
        streamer: Any = None,
        logits_processor: Sequence[TransformersProcessor] | None = None,
        stopping_criteria: Sequence[TransformersCriterion] | None = None,
        **generation_kwargs: Any,
    ) -> dict[str, GenerationOutput]:
        """Generate for every prompt with continuous batching; returns request id -> final output
        (for ``num_return_sequences`` > 1, ids ``{id}`` for sample 0 and ``{id}/{i}`` for the others).
        ``streamer``: a transformers ``BaseStreamer`` for a single prompt, as ``generate(streamer=...)``.
        ``logits_processor`` / ``stopping_criteria``: transformers-style objects applied to every prompt's
        rows, as ``generate`` applies them (engine/generation/user_processors.py)."""
        if streamer is not None and len(inputs) != 1:
            raise ValueError(
                f"a streamer follows one prompt (as transformers' streamers do), got {len(inputs)}"
            )
        config = generation_config or self.generation_defaults
        if generation_kwargs:
            config = config.merged(**generation_kwargs)
        manager = self.init_continuous_batching(max_queue=max(1024, len(inputs) + 1))
        manager.start()
        try:
            for i, ids in enumerate(inputs):
                manager.add_request(
                    ids,
                    request_id=f"batch_req_{i}",
                    generation_config=config,
                    record_timestamps=record_timestamps,
                    streamer=streamer,
                    logits_processor=logits_processor,
                    stopping_criteria=stopping_criteria,
                )
            return _collect_finals(manager, len(inputs), config.num_return_sequences, progress_bar)
        finally:
            manager.stop(block=True, timeout=30)

    def detect_watermark(
        self,
        tokens: Sequence[int] | str,
        watermarking_config: Any,
        z_threshold: float = DEFAULT_Z_THRESHOLD,
        ignore_repeated_ngrams: bool = False,
    ) -> WatermarkDetection:
        """Score a generated output (its token ids, or its text, tokenized without special tokens) against
        the ``watermarking_config`` it was generated with (a dict, a transformers config or one of ours),
        with this model's vocabulary, BOS and EOS (engine/generation/watermark_detect.py)."""
        config = watermarking_config_from(watermarking_config)
        if config is None:
            raise GenerationConfigError("watermarking_config", "is required to detect a watermark")
        if isinstance(tokens, str):
            ids = [int(t) for t in self.tokenizer.encode(tokens, add_special_tokens=False)]
        else:
            ids = list(tokens)
        return detect_watermark(
            ids,
            config,
            self.vocab_size,
            bos_token_id=self.model_config.bos_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            z_threshold=z_threshold,
            ignore_repeated_ngrams=ignore_repeated_ngrams,
        )


def _collect_finals(
    manager: ContinuousBatchingManager, num_prompts: int, num_samples: int, progress_bar: bool
) -> dict[str, GenerationOutput]:
    """Every final output of ``generate_batch``'s requests, keyed ``{id}`` (sample 0) or ``{id}/{i}``,
    with a progress bar of finished prompts and the tokens per second."""
    results: dict[str, GenerationOutput] = {}
    num_tokens = 0
    start = time.perf_counter()
    bar = tqdm(
        total=num_prompts, desc="generate_batch", unit="req", file=sys.stderr, disable=not progress_bar
    )
    with bar:
        while len(results) < num_prompts * num_samples:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("the engine loop stopped before every request finished")
                continue
            if not out.is_finished:
                continue
            key = out.request_id if out.index == 0 else f"{out.request_id}/{out.index}"
            results[key] = out
            num_tokens += len(out.generated_ids)
            if out.index == 0:
                bar.update(1)
            bar.set_postfix(tok_s=f"{num_tokens / max(time.perf_counter() - start, 1e-9):.1f}")
    return results


def _default_model_name(model: str, loaded: LoadedModel) -> str:
    return loaded.source.name or model


def _speculative_config(value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        if value is not None:
            value.validate()
        return value
    return SpeculativeConfig.from_dict(value)
