"""Grammar compilation off the callers' threads, bounded in time (the compiling itself:
engine/generation/grammar.py; the caller: engine/manager.py at admission).

The server's event loop must not compile (a costly schema would stall every stream it serves), and the
engine thread never does (it only reads compiled grammars). ``GrammarWorkers`` runs
``GrammarCompiler.compile`` on a few worker threads; llguidance releases the GIL while it builds a grammar,
so the callers' threads keep running meanwhile.

- ``await compile_async(spec)`` (the server) only awaits; ``compile(spec)`` (the synchronous API) blocks
  its caller. Both answer a cached spec at once, without a worker.
- A caller waits at most ``timeout_s``. If its spec was compiling all that while, it is refused as too
  complex (``GrammarTooComplexError``, HTTP 400); the worker goes on in the background (llguidance's
  parser limits end every compilation) and caches the outcome. If the spec never got a worker (the
  workers were busy with others), or more than ``max_pending`` specs already wait for one, the caller gets
  ``QueueFullError`` (HTTP 429): the server is busy, the spec may be fine.
- The same spec asked for while it compiles shares that compilation: a storm of one costly schema holds
  one worker.
- The compiler is built by the first compilation, on a worker (it reads the whole vocabulary).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import QueueFullError
from engine.generation.errors import GenerationConfigError, GrammarTooComplexError
from engine.generation.grammar import CompiledGrammar, GrammarCompiler
from engine.generation.grammar_spec import GrammarSpec

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_NUM_WORKERS = 2
DEFAULT_MAX_PENDING = 16


@dataclass
class _Job:
    """One spec's compilation: ``started`` once a worker runs it."""

    future: concurrent.futures.Future[CompiledGrammar]
    started: threading.Event = field(default_factory=threading.Event)


class GrammarWorkers:
    """Compiles ``GrammarSpec``s with the compiler ``make_compiler`` builds, on ``num_workers`` threads."""

    def __init__(
        self,
        make_compiler: Callable[[], GrammarCompiler],
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        num_workers: int = DEFAULT_NUM_WORKERS,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be positive, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="cbserve-grammar"
        )
        self._jobs: dict[GrammarSpec, _Job] = {}  # compiling or waiting for a worker
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()  # NOTE: building takes long: never under ``_lock``.

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled, blocking the calling thread at most ``timeout_s``."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        job = self._job(spec)
        try:
            return job.future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(spec, job) from None
        except GenerationConfigError as exc:
            raise _naming(spec, exc) from None

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled, awaiting (never blocking the event loop) at most ``timeout_s``."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        job = self._job(spec)
        try:
            # NOTE: shielded: a caller that gives up must not cancel a compilation others share.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), self.timeout_s)
        except TimeoutError:
            raise self._timed_out(spec, job) from None
        except GenerationConfigError as exc:
            raise _naming(spec, exc) from None

    @property
    def num_pending(self) -> int:
        """Specs compiling or waiting for a worker."""
        with self._lock:
            return len(self._jobs)

    def _cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        with self._lock:
            compiler = self._compiler
        return compiler.cached(spec) if compiler is not None else None

    def _job(self, spec: GrammarSpec) -> _Job:
        """The job compiling ``spec``: the one under way, or a new one."""
        with self._lock:
            job = self._jobs.get(spec)
            if job is not None:
                return job
            waiting = sum(not j.started.is_set() for j in self._jobs.values())
            if waiting >= self.max_pending:
                raise QueueFullError(
                    f"{waiting} structured outputs are waiting to be compiled already; retry later"
                )
            job = _Job(concurrent.futures.Future())
            self._jobs[spec] = job
        self._executor.submit(self._run, spec, job)
        return job

    def _run(self, spec: GrammarSpec, job: _Job) -> None:
        job.started.set()
        try:
            job.future.set_result(self._compiler_now().compile(spec))
        except BaseException as exc:  # NOTE: every waiter must hear, whatever the compiler raised.
            job.future.set_exception(exc)
        finally:
            with self._lock:
                self._jobs.pop(spec, None)

    def _compiler_now(self) -> GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                compiler = self._make_compiler()
                with self._lock:
                    self._compiler = compiler
            return self._compiler

    def _timed_out(self, spec: GrammarSpec, job: _Job) -> Exception:
        if not job.started.is_set():
            return QueueFullError(
                f"no grammar worker was free for {self.timeout_s:g} s (other structured outputs are "
                "compiling); retry later"
            )
        return GrammarTooComplexError(
            spec.field, f"too complex: its grammar did not compile within {self.timeout_s:g} s"
        )


def _naming(spec: GrammarSpec, exc: GenerationConfigError) -> GenerationConfigError:
    """``exc`` naming ``spec``'s field: callers sharing one compilation may have sent the spec in
    different fields (the field is not part of a spec's identity)."""
    if exc.field == spec.field:
        return exc
    return type(exc)(spec.field, str(exc).removeprefix(f"{exc.field}: "))
