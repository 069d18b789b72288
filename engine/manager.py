"""The continuous-batching manager: the public API of the engine loop (engine/loop.py), for the callers'
threads.

Requests are checked here (engine/admission.py), then cross into the engine thread through its inbox;
outputs cross back onto one queue per request: an asyncio queue for the server (handed over once per
step for all of them, see engine/request_handle.py), a plain queue for the synchronous API. Nothing else
is shared.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from engine.admission import RequestLimits, check_prompt
from engine.beam_group import BeamSearchGroup
from engine.contrastive_group import ContrastiveGroup
from engine.errors import EngineDeadError, ExecutorFailedError, QueueFullError
from engine.executor.dola import LayerContrast
from engine.executor.draft_model import DraftModel
from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.grammar import CompiledGrammar, GrammarCompiler
from engine.generation.grammar_spec import GrammarSpec
from engine.generation.sampler import Sampler
from engine.generation.speculation import Speculation
from engine.generation.user_processors import RequestHooks, TransformersCriterion, TransformersProcessor
from engine.grammar_workers import DEFAULT_COMPILE_TIMEOUT_S, GrammarWorkers
from engine.inbox import AddRequest, CancelRequest, EvictRequest, ResetPrefixCache
from engine.loop import EngineLoop, Executor
from engine.outputs import GenerationOutput
from engine.request_handle import AsyncSink, RequestHandle, Sink, SyncSink
from engine.sequence_group import SequenceGroup
from engine.speculative.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig, speculation_for
from engine.speculative.early_exit import Drafter, EarlyExitProposer
from engine.speculative.speculator import Speculator
from engine.stats import EngineStats
from engine.streamer_sink import StreamerSink
from kvcache.events import KVCacheEvent
from scheduler.base import Scheduler
from scheduler.errors import RequestTooLargeError


class ContinuousBatchingManager:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        sampler: Sampler,
        tokenizer: Any,
        generation_defaults: GenerationConfig,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        max_queue: int = 1024,
        grammar_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        layer_contrast: LayerContrast | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults
        self.vocab_size = vocab_size
        self.limits = RequestLimits(max_model_len, scheduler.block_size, scheduler.num_blocks)
        self.eos_token_ids = eos_token_ids
        self.max_queue = max_queue
        self.layer_contrast = layer_contrast  # None: the model cannot give its layers' logits (no DoLa)
        # False: the executor cannot give its rows' final hidden states (no contrastive search)
        self.gives_hidden_states = bool(getattr(executor, "supports_hidden_states", False))
        self.speculative_config = speculative_config  # None: only requests that ask for prompt lookup draft
        disable_by = (
            speculative_config.disable_by_batch_size if speculative_config else DEFAULT_DISABLE_BY_BATCH_SIZE
        )
        # NOTE: a model that gives its layers' logits (layer_contrast) can draft with its first layers.
        early_exit = None
        if layer_contrast is not None and isinstance(executor, Drafter):
            early_exit = EarlyExitProposer(executor, scheduler.kv_manager)
        draft_model = getattr(executor, "draft_model", None)
        if isinstance(draft_model, DraftModel):
            draft_proposer: EarlyExitProposer | None = EarlyExitProposer(draft_model, scheduler.kv_manager)
        else:
            draft_proposer = None
        self.loop = EngineLoop(
            scheduler, executor, sampler, Speculator(disable_by, early_exit, draft_proposer, tokenizer)
        )
        if speculative_config is not None:
            self._check_speculation(
                speculation_for(generation_defaults, speculative_config), "speculative_config"
            )
        self._thread: threading.Thread | None = None
        self._admission_lock = threading.Lock()  # NOTE: the queue-full check and the put are one step.
        self._ready: queue.Queue[str] = queue.Queue()
        self._sync_sinks: dict[str, SyncSink] = {}
        # NOTE: the compiler reads the whole vocabulary: only servers that constrain an output build it.
        self.grammars = GrammarWorkers(self._new_grammar_compiler, grammar_timeout_s)

    @property
    def executor(self) -> Executor:
        """The engine thread's executor; tests may wrap it (read at every step)."""
        return self.loop.executor

    @executor.setter
    def executor(self, executor: Executor) -> None:
        self.loop.executor = executor

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self.loop.stopping.clear()
        self.loop.dead = None
        self._thread = threading.Thread(target=self.loop.run, name="cbserve-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.loop.stopping.is_set()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the loop. Requests still unfinished get a final output with status failed."""
        self.loop.stopping.set()
        self.loop.inbox.wake()
        if block:
            self.join(timeout)

    @property
    def executor_failure(self) -> ExecutorFailedError | None:
        """What stopped the loop for good when its executor can run no more steps (a rank of a sharded
        model died), else None: the process should exit and be restarted."""
        dead = self.loop.dead
        return dead if isinstance(dead, ExecutorFailedError) else None

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ submitting
    def submit(
        self,
        prompt_ids: list[int],
        generation_config: GenerationConfig | None = None,
        request_id: str | None = None,
        record_timestamps: bool = True,
        grammar: CompiledGrammar | None = None,
    ) -> RequestHandle:
        """Admit a request from a running asyncio loop; its outputs stream through the returned handle.
        A constrained request passes its ``grammar`` from ``await compile_grammar(spec)``: compiling here
        would block the event loop."""
        spec = (generation_config or self.generation_defaults).structured_output
        if spec is not None and grammar is None:
            raise ValueError("a constrained request needs its grammar: `await compile_grammar(spec)` first")
        sink = AsyncSink(asyncio.get_running_loop())
        group = self._new_group(
            prompt_ids, generation_config, request_id, sink, True, record_timestamps, grammar
        )
        self._enqueue(group)
        return RequestHandle(self, group.request_id, group.n, sink)

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        generation_config: GenerationConfig | None = None,
        streamer: Any = None,
        logits_processor: Sequence[TransformersProcessor] | None = None,
        stopping_criteria: Sequence[TransformersCriterion] | None = None,
        **generation_kwargs: Any,
    ) -> str:
        """Admit a request; read its outputs with ``get_result`` or ``request_id_iter``. With
        ``streaming`` every step's output is delivered, otherwise only the final one. ``streamer``: a
        transformers ``BaseStreamer`` (``TextStreamer``, ``TextIteratorStreamer``, ...) fed the prompt and
        then each token as it is generated (engine/streamer_sink.py); one sequence only.
        ``logits_processor`` / ``stopping_criteria``: transformers-style objects (a list, or a
        ``LogitsProcessorList`` / ``StoppingCriteriaList``) run for this request's rows alone, in order
        (engine/generation/user_processors.py)."""
        config = generation_config or self.generation_defaults
        overrides = dict(generation_kwargs)
        if max_new_tokens is not None:
            overrides["max_new_tokens"] = max_new_tokens
        if overrides:
            config = config.merged(**overrides)
        hooks = RequestHooks.of(logits_processor, stopping_criteria)
        rid = request_id or _new_request_id()
        sink = SyncSink(rid, self._ready, config.num_return_sequences)
        if streamer is None:
            group = self._new_group(input_ids, config, rid, sink, streaming, record_timestamps, hooks=hooks)
        else:
            if config.num_return_sequences != 1 or config.is_beam_search:
                raise GenerationConfigError(
                    "streamer",
                    "a streamer follows one sequence: num_return_sequences and num_beams must be 1",
                )
            fed = StreamerSink(sink, streamer, pass_every_output=streaming)
            group = self._new_group(input_ids, config, rid, fed, True, record_timestamps, hooks=hooks)
            fed.start(list(input_ids))
        self._sync_sinks[rid] = sink
        self._enqueue(group)
        return rid

    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled on a grammar worker (engine/grammar_workers.py), awaiting at most the
        compile timeout: ``GenerationConfigError`` (``GrammarTooComplexError``) or ``QueueFullError``."""
        return await self.grammars.compile_async(spec)

    def cancel_request(self, request_id: str) -> None:
        """Cancel at the next step: blocks are freed and one final output with status cancelled is sent."""
        self.loop.inbox.put(CancelRequest(request_id))

    def evict_request_from_cache(self, request_id: str) -> None:
        """Drop a finished request's blocks from the prefix cache (they are otherwise kept for reuse)."""
        self.loop.inbox.put(EvictRequest(request_id))

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache at the next step: True, or False while any request holds blocks."""
        message = ResetPrefixCache()
        self.loop.inbox.put(message)
        return await asyncio.wrap_future(message.done)

    def add_kv_event_observer(self, fn: Callable[[list[KVCacheEvent]], None]) -> None:
        """``fn(events)`` is called from the engine thread with the KV-cache events of each step, in order;
        the scheduler records them only when built with ``enable_kv_cache_events``."""
        self.loop.kv_event_observers.append(fn)

    def add_step_observer(self, fn: Callable[[int], None]) -> None:
        """``fn(num_tokens)`` is called from the engine thread after every step."""
        self.loop.step_observers.append(fn)

    def add_finish_observer(self, fn: Callable[[GenerationOutput], None]) -> None:
        """``fn(output)`` is called from the engine thread with every sample's final output (finished,
        cancelled or failed), whether or not anybody reads it."""
        self.loop.outputs.finish_observers.append(fn)

    # ------------------------------------------------------------------ reading (synchronous API)
    def get_result(self, timeout: float | None = None) -> GenerationOutput | None:
        """The next output of any request added with ``add_request``; None after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rid = self._ready.get(timeout=remaining)
            except queue.Empty:
                return None
            sink = self._sync_sinks.get(rid)
            if sink is None:
                continue
            try:
                out = sink.queue.get_nowait()
            except queue.Empty:  # NOTE: already consumed through request_id_iter.
                continue
            self._consumed(sink, out)
            return out

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Outputs of one request as they come, until it finishes."""
        sink = self._sync_sinks.get(request_id)
        if sink is None:
            raise KeyError(f"unknown request id {request_id!r}")
        while sink.unread_finals:
            try:
                out = sink.queue.get(timeout=timeout)
            except queue.Empty:
                return
            self._consumed(sink, out)
            yield out

    def _consumed(self, sink: SyncSink, out: GenerationOutput) -> None:
        if out.is_finished:
            sink.unread_finals -= 1
            if sink.unread_finals == 0:
                self._sync_sinks.pop(sink.request_id, None)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        return self.loop.stats

    def num_unfinished(self) -> int:
        stats = self.loop.stats
        return self.loop.inbox.num_adds + stats.num_requests_running + stats.num_requests_waiting

    def check_integrity(self) -> None:
        """Verify the scheduler and allocator; call only while the loop is idle or stopped."""
        self.scheduler.check_integrity()

    # ------------------------------------------------------------------ admission (caller's thread)
    def _new_group(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None,
        request_id: str | None,
        sink: Sink,
        streaming: bool,
        record_timestamps: bool,
        grammar: CompiledGrammar | None = None,
        hooks: RequestHooks | None = None,
    ) -> SequenceGroup:
        if self.loop.dead is not None or not self.is_running():
            raise EngineDeadError(f"the engine loop is not running{self.loop.death_reason()}")
        config = config or self.generation_defaults
        config.validate(vocab_size=self.vocab_size)
        if config.logits_processor_args is not None and not self.loop.sampler.logits_processors:
            raise GenerationConfigError(
                "logits_processor_args", "this server loads no logits processors (--logits-processors)"
            )
        prompt_ids = list(prompt_ids)
        check_prompt(prompt_ids, self.vocab_size)
        max_new = config.max_new_tokens
        if max_new is None:
            max_new = self.limits.default_max_new_tokens(len(prompt_ids))
        rid = request_id or _new_request_id()
        self.limits.check_fits(len(prompt_ids), max_new, rid)
        grammar = self._grammar_of(config, grammar)
        exit_layers = self._dola_layers(config)
        beams = config.is_beam_search
        contrastive = config.is_contrastive_search
        if beams:
            self._check_beams(config, len(prompt_ids), max_new, rid, hooks)
        if contrastive:
            self._check_contrastive_search(config, len(prompt_ids), max_new, rid, hooks)
        # NOTE: a beam (a contrastive search's candidate) continues by its score only: no beam drafts
        speculation = None if beams or contrastive else speculation_for(config, self.speculative_config)
        self._check_speculation(speculation, "assistant_early_exit")
        group_class = BeamSearchGroup if beams else ContrastiveGroup if contrastive else SequenceGroup
        return group_class(
            rid,
            prompt_ids,
            config,
            max_new,
            sink,
            streaming,
            record_timestamps,
            self.tokenizer,
            self.eos_token_ids,
            grammar=grammar,
            hooks=hooks,
            exit_layers=exit_layers,
            speculation=speculation,
        )

    def _check_beams(
        self, config: GenerationConfig, prompt_len: int, max_new: int, rid: str, hooks: RequestHooks | None
    ) -> None:
        """A beam search runs only when all its beams fit one step and, each at full length, the cache."""
        if hooks is not None:
            raise GenerationConfigError(
                "logits_processor", "a request's own processors and stopping criteria cannot run with beams"
            )
        self._check_forks_fit("num_beams", config.num_beams, "beams", prompt_len, max_new, rid)

    def _check_contrastive_search(
        self, config: GenerationConfig, prompt_len: int, max_new: int, rid: str, hooks: RequestHooks | None
    ) -> None:
        """Contrastive search needs the model's hidden states, and its ``top_k`` candidates in one step."""
        if hooks is not None:
            raise GenerationConfigError(
                "logits_processor",
                "a request's own processors and stopping criteria cannot run with contrastive search",
            )
        if not self.gives_hidden_states:
            raise GenerationConfigError(
                "penalty_alpha",
                "this model's implementation cannot give its hidden states (contrastive search)",
            )
        top_k = min(config.top_k, self.vocab_size)
        self._check_forks_fit("top_k", top_k, "candidates", prompt_len, max_new, rid)

    def _check_forks_fit(
        self, field: str, num_forks: int, what: str, prompt_len: int, max_new: int, rid: str
    ) -> None:
        """A request of ``num_forks`` forks (beams, candidates) runs only when all fit one step and, each at
        full length, the cache."""
        if num_forks > self.scheduler.config.max_num_seqs:
            raise GenerationConfigError(
                field,
                f"({num_forks}) must not exceed the engine's max_num_seqs "
                f"({self.scheduler.config.max_num_seqs}): all the {what} run in the same step",
            )
        # NOTE: conservative (forks share their prefix): it makes sure a preempted request can come back.
        fork_blocks = num_forks * -(-(prompt_len + max_new) // self.limits.block_size)
        if fork_blocks > self.limits.num_blocks:
            raise RequestTooLargeError(
                rid,
                prompt_len + max_new,
                fork_blocks,
                self.limits.num_blocks,
                f"{num_forks} {what} of {prompt_len} prompt tokens + {max_new} new tokens need "
                f"{fork_blocks} KV blocks, but the cache holds only {self.limits.num_blocks} blocks",
            )

    def _check_speculation(self, speculation: Speculation | None, field: str) -> None:
        """Early exit needs a model that gives its layers' logits, through fewer layers than it has; a draft
        model must be loaded."""
        if (
            speculation is not None
            and speculation.method == "draft_model"
            and self.loop.speculator.draft_model is None
        ):
            raise GenerationConfigError(
                field, "no draft model is loaded (Engine.from_pretrained's speculative_config)"
            )
        if speculation is None or speculation.method != "early_exit":
            return
        if self.layer_contrast is None:
            raise GenerationConfigError(
                field, "this model's implementation cannot draft with its first layers"
            )
        num_layers = speculation.num_layers or 0
        if not 1 <= num_layers < self.layer_contrast.num_layers:
            raise GenerationConfigError(
                field,
                f"the drafting layers must be 1 to {self.layer_contrast.num_layers - 1}, got {num_layers}",
            )

    def _dola_layers(self, config: GenerationConfig) -> tuple[int, ...]:
        """DoLa's candidate layers of this model for the request (none without ``dola_layers``)."""
        if config.dola_layers is None:
            return ()
        if self.layer_contrast is None:
            raise GenerationConfigError(
                "dola_layers", "this model's implementation cannot give its layers' logits"
            )
        try:
            return self.layer_contrast.candidate_layers(config.dola_layers)
        except ValueError as e:
            raise GenerationConfigError("dola_layers", str(e)) from e

    def _grammar_of(
        self, config: GenerationConfig, compiled: CompiledGrammar | None
    ) -> CompiledGrammar | None:
        """The request's compiled grammar: the one given (it must be ``config``'s), else compiled on a
        grammar worker while this (synchronous) caller waits. The engine thread never compiles."""
        spec = config.structured_output
        if compiled is not None and compiled.spec != spec:
            raise ValueError(f"the grammar given was compiled from {compiled.spec!r}, not from {spec!r}")
        if spec is None or compiled is not None:
            return compiled
        return self.grammars.compile(spec)

    def _new_grammar_compiler(self) -> GrammarCompiler:
        return GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def _enqueue(self, group: SequenceGroup) -> None:
        with self._admission_lock:
            waiting = self.loop.inbox.num_adds + self.loop.stats.num_requests_waiting
            if waiting >= self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); retry later")
            self.loop.inbox.put(AddRequest(group))


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"
