"""transformers' streamers (``TextStreamer``, ``TextIteratorStreamer``, ``AsyncTextIteratorStreamer``, or
any ``BaseStreamer``: an object with ``put(token_ids)`` and ``end()``) fed by one request of the continuous
batch, as ``GenerationMixin.generate(streamer=...)`` feeds them: the prompt first (a streamer with
``skip_prompt`` drops it), then each new token as it is generated, then ``end()``.

``StreamerSink`` wraps the request's own sink: every output passes through to it unchanged (only the final
one unless the caller asked for streaming), and the new token ids go to the streamer on the engine thread as
the step publishes them. A streamer that raises is not fed again (and is ended, so that an iterating reader
is not left waiting); the request itself goes on.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from engine.outputs import GenerationOutput
from engine.request_handle import Sink

logger = logging.getLogger(__name__)


class Streamer(Protocol):
    """transformers' ``BaseStreamer``."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


class StreamerSink:
    """``inner``'s outputs, with each new token also handed to ``streamer`` (see the module docstring)."""

    def __init__(self, inner: Sink, streamer: Any, pass_every_output: bool) -> None:
        if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
            raise TypeError(
                f"a streamer needs put(token_ids) and end() (transformers' BaseStreamer), got {streamer!r}"
            )
        self.inner = inner
        self.streamer: Any = streamer
        self.pass_every_output = pass_every_output

    def start(self, prompt_ids: list[int]) -> None:
        """Hand the streamer the prompt (once the request is admitted), as ``generate()`` does first."""
        self._feed(
            lambda: self.streamer.put(torch.tensor([prompt_ids]))
        )  # NOTE: [1, L], as generate() puts it

    def put(self, out: GenerationOutput) -> None:
        for token_id in out.delta_ids:
            self._feed(lambda t=token_id: self.streamer.put(torch.tensor([t])))
        if out.is_finished:
            self._feed(lambda: self.streamer.end())
        if out.is_finished or self.pass_every_output:
            self.inner.put(out)

    def flush(self) -> None:
        self.inner.flush()

    def _feed(self, call: Any) -> None:
        if self.streamer is None:
            return
        try:
            call()
        except Exception:  # NOTE: the user's streamer must not take the engine loop down.
            logger.exception("streamer %r raised: it is not fed again", self.streamer)
            streamer, self.streamer = self.streamer, None
            try:
                streamer.end()
            except Exception:
                pass
