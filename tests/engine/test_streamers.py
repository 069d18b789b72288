"""transformers' own streamers (TextStreamer, TextIteratorStreamer, AsyncTextIteratorStreamer) fed by a
request of the continuous batch on the default model, through ``add_request(streamer=...)`` and
``generate_batch(streamer=...)``: what they print or yield is the request's text, beside other requests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from default_engine import engine_on
from transformers import AsyncTextIteratorStreamer, TextIteratorStreamer, TextStreamer

from engine.engine import Engine
from engine.generation.config import GenerationConfigError
from engine.loader.model_loader import LoadedModel

PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=256)


def test_text_iterator_streamer_yields_the_request_text_beside_other_requests(engine: Engine) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        streamer = TextIteratorStreamer(engine.tokenizer, skip_prompt=True, timeout=120)
        others = [
            manager.add_request(engine.tokenizer.encode(f"Count to {i}:"), max_new_tokens=24) for i in (3, 9)
        ]
        rid = manager.add_request(
            engine.tokenizer.encode(PROMPT), max_new_tokens=40, do_sample=False, streamer=streamer
        )
        pieces = list(streamer)  # NOTE: blocks until end(); raises queue.Empty after the timeout
        finals = {}
        while len(finals) < 3:
            out = manager.get_result(timeout=120)
            assert out is not None
            finals[out.request_id] = out  # NOTE: without streaming=True only final outputs arrive
    finally:
        manager.stop(timeout=30)
    assert all(finals[o].is_finished for o in [*others, rid])
    assert len(pieces) > 3 and "".join(pieces) == finals[rid].text
    manager.check_integrity()


def test_text_streamer_prints_the_prompt_and_the_output(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt_ids = engine.tokenizer.encode(PROMPT)
    outs = engine.generate_batch(
        [prompt_ids],
        progress_bar=False,
        max_new_tokens=24,
        do_sample=False,
        streamer=TextStreamer(engine.tokenizer),
    )
    out = outs["batch_req_0"]
    printed = capsys.readouterr().out
    assert printed == engine.tokenizer.decode(prompt_ids + out.generated_ids) + "\n"


def test_async_text_iterator_streamer(engine: Engine) -> None:
    async def main() -> tuple[str, str]:
        streamer = AsyncTextIteratorStreamer(engine.tokenizer, skip_prompt=True, timeout=120)
        ids = [engine.tokenizer.encode(PROMPT)]
        task = asyncio.create_task(
            asyncio.to_thread(
                engine.generate_batch,
                ids,
                progress_bar=False,
                max_new_tokens=16,
                do_sample=False,
                streamer=streamer,
            )
        )
        text = "".join([piece async for piece in streamer])
        return text, (await task)["batch_req_0"].text

    streamed, final = asyncio.run(main())
    assert streamed == final and final


class _Broken:
    def __init__(self) -> None:
        self.calls = 0
        self.ended = threading.Event()

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the user's streamer broke")

    def end(self) -> None:
        self.ended.set()


def test_a_streamer_that_raises_leaves_its_request_and_the_engine_running(engine: Engine) -> None:
    broken = _Broken()
    outs = engine.generate_batch(
        [engine.tokenizer.encode(PROMPT)],
        progress_bar=False,
        max_new_tokens=12,
        do_sample=False,
        streamer=broken,
    )
    assert len(outs["batch_req_0"].generated_ids) == 12 and broken.calls == 3 and broken.ended.is_set()


@pytest.mark.parametrize("bad", ["n", "batch", "object"])
def test_streamer_misuse_is_refused(engine: Engine, bad: str) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    kwargs: dict[str, Any] = {"progress_bar": False, "max_new_tokens": 4}
    if bad == "n":
        with pytest.raises(GenerationConfigError, match="streamer"):
            engine.generate_batch(
                [ids],
                streamer=TextStreamer(engine.tokenizer),
                num_return_sequences=2,
                do_sample=True,
                **kwargs,
            )
    elif bad == "batch":
        with pytest.raises(ValueError, match="one prompt"):
            engine.generate_batch([ids, ids], streamer=TextStreamer(engine.tokenizer), **kwargs)
    else:
        with pytest.raises(TypeError, match="put"):
            engine.generate_batch([ids], streamer=object(), **kwargs)
