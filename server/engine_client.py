"""How a route talks to the engine: submit every prompt of one HTTP request, read their outputs as one
stream, cancel them all when the client goes away.

A multi-prompt request is one engine request per prompt; all are checked before any is submitted, and if
a submit fails (queue full, ...) the ones already submitted are cancelled, so a request is admitted whole
or not at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request

from engine.generation.config import GenerationConfig
from engine.generation.grammar_spec import GrammarSpec
from engine.outputs import GenerationOutput, RequestStatus
from server.errors import APIError, api_error_from_engine

if TYPE_CHECKING:
    from engine.generation.grammar import CompiledGrammar
    from engine.manager import ContinuousBatchingManager
    from engine.request_handle import RequestHandle

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    """The client closed the connection before its (non-streaming) response was ready."""


class Submission:
    """The engine requests of one HTTP request: prompt ``i`` is ``handles[i]``."""

    def __init__(self, handles: list[RequestHandle], prompts: list[list[int]]) -> None:
        self.handles = handles
        self.prompts = prompts

    @property
    def num_prompt_tokens(self) -> int:
        """Usage's ``prompt_tokens``: every prompt counted once, whatever ``n``."""
        return sum(len(p) for p in self.prompts)

    def cancel(self) -> None:
        """Cancel every request not finished yet (idempotent)."""
        for handle in self.handles:
            if not handle.finished:
                handle.cancel()

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """``(prompt index, output)`` of every prompt as they come; ends when all have finished.
        Leaving early (or being cancelled) cancels what is unfinished."""
        try:
            if len(self.handles) == 1:
                async for out in self.handles[0]:
                    yield 0, out
                return
            queue: asyncio.Queue[tuple[int, GenerationOutput | None]] = asyncio.Queue()

            async def pump(i: int, handle: RequestHandle) -> None:
                try:
                    async for out in handle:
                        queue.put_nowait((i, out))
                finally:
                    queue.put_nowait((i, None))

            tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
            try:
                remaining = len(tasks)
                while remaining:
                    i, item = await queue.get()
                    if item is None:
                        remaining -= 1
                        continue
                    yield i, item
                for task in tasks:
                    await task  # NOTE: re-raises a pump's exception instead of losing it.
            finally:
                for task in tasks:
                    task.cancel()
        finally:
            self.cancel()


async def compile_grammar(
    manager: ContinuousBatchingManager, spec: GrammarSpec | None, prompt_param: str
) -> CompiledGrammar | None:
    """``spec`` compiled on the engine's grammar workers (awaited); engine errors become ``APIError``
    (400 naming the field for a spec too complex or invalid, 429 when the workers are busy)."""
    if spec is None:
        return None
    try:
        return await manager.compile_grammar(spec)
    except Exception as exc:
        error = api_error_from_engine(exc, prompt_param)
        if error is None:
            raise
        raise error from exc


def submit_prompts(
    manager: ContinuousBatchingManager,
    prompts: list[list[int]],
    configs: list[GenerationConfig],
    base_request_id: str,
    prompt_param: str,
    grammar: CompiledGrammar | None = None,
) -> Submission:
    """Submit one engine request per prompt (ids ``{base_request_id}-{i}``), each constrained by
    ``grammar`` when given (compiled from the configs' spec); engine errors become ``APIError``
    (400 / 429 / 503)."""
    handles: list[RequestHandle] = []
    try:
        for i, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
            rid = f"{base_request_id}-{i}"
            handles.append(manager.submit(prompt, config, request_id=rid, grammar=grammar))
    except Exception as exc:
        for handle in handles:
            handle.cancel()
        error = api_error_from_engine(exc, prompt_param)
        if error is None:
            raise
        raise error from exc
    return Submission(handles, prompts)


def output_error(out: GenerationOutput, engine_running: bool) -> APIError | None:
    """The error a failed or cancelled output stands for (None for a normal output)."""
    if out.status is RequestStatus.FAILED:
        if not engine_running:
            return APIError(503, f"the engine stopped: {out.error or 'unknown error'}", code="engine_dead")
        if out.error_code is not None:  # the request's own options: a client error found while generating
            return APIError(400, out.error or "invalid generation options", code=out.error_code)
        return APIError(500, f"generation failed: {out.error or 'unknown error'}", code="generation_failed")
    if out.status is RequestStatus.CANCELLED:
        return APIError(503, "the request was cancelled by the server", code="cancelled")
    return None


async def collect_final_outputs(
    submission: Submission,
    request: Request,
) -> dict[tuple[int, int], GenerationOutput]:
    """Wait for every sample's final output, keyed ``(prompt index, sample index)``. Watches the
    connection meanwhile: a client that leaves cancels its requests (raises ``ClientDisconnected``)."""
    finals: dict[tuple[int, int], GenerationOutput] = {}

    async def consume() -> None:
        async for i, out in submission.outputs():
            if out.is_finished:
                finals[(i, out.index)] = out

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return finals
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            submission.cancel()
