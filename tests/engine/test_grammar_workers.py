"""Grammar compilation on worker threads (engine/grammar_workers.py), over a stand-in compiler whose
compilation of a ``slow...`` spec holds until the test opens its gate: the wait is bounded (too complex
when the spec was compiling, busy when it never got a worker), other specs compile meanwhile, one spec
compiles once however many ask, and an awaiting caller leaves its event loop free."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from engine.errors import QueueFullError
from engine.generation.errors import GenerationConfigError, GrammarTooComplexError
from engine.generation.grammar_spec import GrammarSpec
from engine.grammar_workers import GrammarWorkers

SHORT_TIMEOUT_S = 1.0  # the gate stays shut far longer: the outcome does not depend on the machine's speed
GATE_TIMEOUT_S = 30.0


class GatedCompiler:
    """``compile`` of a spec whose text starts with ``slow`` waits for ``gate`` (and of ``slow-bad``,
    then fails naming the spec's field); any other compiles at once. Compiled specs are cached."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[str] = []
        self._cache: dict[GrammarSpec, object] = {}

    def cached(self, spec: GrammarSpec) -> object | None:
        return self._cache.get(spec)

    def compile(self, spec: GrammarSpec) -> object:
        self.calls.append(spec.text)
        if spec.text.startswith("slow") and not self.gate.wait(GATE_TIMEOUT_S):
            raise AssertionError("the test never opened the gate")
        if spec.text == "slow-bad":
            raise GenerationConfigError(spec.field, "invalid regex: no such thing")
        compiled = object()  # stands for a CompiledGrammar
        self._cache[spec] = compiled
        return compiled


@pytest.fixture
def compiler() -> Iterator[GatedCompiler]:
    compiler = GatedCompiler()
    yield compiler
    compiler.gate.set()  # NOTE: never leave a worker waiting behind the test


def workers_over(compiler: GatedCompiler, **options: float) -> GrammarWorkers:
    return GrammarWorkers(lambda: compiler, **options)  # type: ignore[arg-type, return-value]


def test_a_compilation_past_the_timeout_is_too_complex_while_others_compile(compiler: GatedCompiler) -> None:
    workers = workers_over(compiler, timeout_s=SHORT_TIMEOUT_S, num_workers=2)
    with pytest.raises(GrammarTooComplexError, match="too complex") as info:
        workers.compile(GrammarSpec.regex("slow-a+", "guided_regex"))
    assert info.value.field == "guided_regex"
    fast = GrammarSpec.regex("b+")
    assert workers.compile(fast) is compiler.cached(fast)  # the other worker, while the first is held
    compiler.gate.set()
    # The held compilation went on in the background; its grammar is cached once it ends.
    workers._executor.shutdown(wait=True)
    assert compiler.cached(GrammarSpec.regex("slow-a+")) is not None


def test_busy_workers_answer_retry_later_not_too_complex(compiler: GatedCompiler) -> None:
    workers = workers_over(compiler, timeout_s=SHORT_TIMEOUT_S, num_workers=1, max_pending=1)
    with pytest.raises(GrammarTooComplexError):
        workers.compile(GrammarSpec.regex("slow-a+"))  # holds the only worker
    with pytest.raises(QueueFullError, match="retry later"):
        workers.compile(GrammarSpec.regex("b+"))  # waited, never got the worker
    with pytest.raises(QueueFullError, match="waiting"):
        workers.compile(GrammarSpec.regex("c+"))  # b+ still waits: no room for another, refused at once
    assert compiler.calls == ["slow-a+"]
    compiler.gate.set()
    workers._executor.shutdown(wait=True)
    assert compiler.calls == ["slow-a+", "b+"] and workers.num_pending == 0


def test_one_spec_compiles_once_and_each_caller_hears_of_its_own_field(compiler: GatedCompiler) -> None:
    workers = workers_over(compiler, timeout_s=GATE_TIMEOUT_S)
    fields = ["guided_regex", "structured_outputs.regex", "response_format"]

    async def main() -> list[BaseException | object]:
        calls = [asyncio.create_task(workers.compile_async(GrammarSpec.regex("slow-bad", f))) for f in fields]
        await asyncio.sleep(0)  # NOTE: each task runs up to its await: all three wait on the one job
        compiler.gate.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    errors = asyncio.run(main())
    assert compiler.calls == ["slow-bad"]
    assert [getattr(e, "field", None) for e in errors] == fields
    assert all(isinstance(e, GenerationConfigError) and "no such thing" in str(e) for e in errors)


def test_an_awaiting_caller_leaves_its_event_loop_free(compiler: GatedCompiler) -> None:
    workers = workers_over(compiler, timeout_s=SHORT_TIMEOUT_S)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        with pytest.raises(GrammarTooComplexError):
            await workers.compile_async(GrammarSpec.regex("slow-a+", "guided_regex"))
        task.cancel()
        return ticks

    assert asyncio.run(main()) > 1  # the loop ran while the compilation was held
    compiler.gate.set()
    workers._executor.shutdown(wait=True)
    # Giving up did not cancel the shared compilation: it ended and is cached.
    assert compiler.cached(GrammarSpec.regex("slow-a+")) is not None
