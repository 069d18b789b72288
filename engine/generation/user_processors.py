"""User decoding hooks: logits processors and stopping criteria written outside cbserve, run per row
inside the continuous batch beside the rows that use none.

Two kinds of logits processor run at the same place of the pipeline (processors.py), where
transformers' ``_get_logits_processor`` merges the ``logits_processor`` given to ``generate``: after the
processors it builds itself from the config, before the sampling warpers and the watermark.

- Server processors (``--logits-processors``, loaded by processor_plugins.py): one instance for the
  server, called once a step with the rows whose request carries ``logits_processor_args`` (a dict; the
  same for every processor: each reads its own keys and leaves the rows without them alone):
  ``processor(rows: list[ProcessorRow], logits: Tensor[len(rows), V] float32) -> Tensor[len(rows), V]``.
  It may change ``logits`` in place and return it. When a batched call raises, each of its rows is
  retried alone, so that only the rows that fail alone fail.
- Request processors (the Python API's ``logits_processor=[...]``): transformers' call convention,
  ``processor(input_ids: LongTensor[1, L], scores: FloatTensor[1, V]) -> FloatTensor[1, V]``, with
  ``input_ids`` the row's prompt and its output so far; applied one row at a time, in the order given.

A processor that raises, or returns something other than a float tensor of the input's shape without
NaN, fails only the rows it was called for (error code ``logits_processor_failed``).

Stopping criteria (the Python API's ``stopping_criteria=[...]``) take transformers' convention,
``criterion(input_ids: LongTensor[1, L], scores: None) -> BoolTensor[1]`` (``scores`` is None, as
``generate`` passes it unless ``output_scores``), checked after each token (which stays in the output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.generation.errors import GenerationConfigError

PROCESSOR_FAILED = "logits_processor_failed"  # the error code of a row whose processor failed

TransformersProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TransformersCriterion = Callable[..., Any]


@dataclass(frozen=True)
class ProcessorRow:
    """What a server processor sees of one row: its tokens and its request's ``logits_processor_args``."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    args: Mapping[str, Any]

    @property
    def token_ids(self) -> list[int]:
        """The prompt followed by the tokens generated so far."""
        return [*self.prompt_ids, *self.output_ids]


class BatchedLogitsProcessor(Protocol):
    """A server processor: built once with ``(tokenizer, vocab_size)``, then called once a step."""

    def __call__(self, rows: list[ProcessorRow], logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RequestHooks:
    """One request's transformers-style processors and stopping criteria (Python API), in order."""

    logits_processors: tuple[TransformersProcessor, ...] = ()
    stopping_criteria: tuple[TransformersCriterion, ...] = ()

    @classmethod
    def of(
        cls,
        logits_processor: Iterable[TransformersProcessor] | None,
        stopping_criteria: Iterable[TransformersCriterion] | None,
    ) -> RequestHooks | None:
        """The hooks given to ``add_request`` (a list, or transformers' ``LogitsProcessorList`` /
        ``StoppingCriteriaList``); None when there are none. Raises ``GenerationConfigError`` for an
        object that cannot be called."""
        processors = _callables("logits_processor", logits_processor)
        criteria = _callables("stopping_criteria", stopping_criteria)
        if not processors and not criteria:
            return None
        return cls(processors, criteria)

    def should_stop(self, token_ids: Sequence[int]) -> bool:
        """Whether any criterion stops the row whose tokens (prompt and output) are ``token_ids``; a
        criterion that raises or answers something else than a bool raises ``StoppingCriterionError``."""
        input_ids = _input_ids(token_ids, torch.device("cpu"))
        for k, criterion in enumerate(self.stopping_criteria):
            owner = f"stopping_criteria[{k}] ({_name(criterion)})"
            try:
                verdict = _as_bool(criterion(input_ids, None))
            except Exception as exc:
                raise StoppingCriterionError(f"{owner} failed: {exc!r}") from exc
            if verdict:
                return True
        return False


class StoppingCriterionError(RuntimeError):
    """A request's stopping criterion raised, or answered something that is not a bool."""


def _as_bool(verdict: Any) -> bool:
    if isinstance(verdict, torch.Tensor):
        if verdict.numel() != 1 or verdict.dtype != torch.bool:
            raise TypeError(
                f"returned a {verdict.dtype} tensor of shape {tuple(verdict.shape)}, not one bool"
            )
        return bool(verdict.item())
    if not isinstance(verdict, bool):
        raise TypeError(f"returned {verdict!r}, not a bool")
    return verdict


def _callables(field_name: str, objects: Iterable[Any] | None) -> tuple[Any, ...]:
    if objects is None:
        return ()
    if callable(objects) and not isinstance(objects, (list, tuple)):
        objects = [objects]
    out = tuple(objects)
    for obj in out:
        if not callable(obj):
            raise GenerationConfigError(field_name, f"{obj!r} cannot be called")
    return out


def _name(obj: Any) -> str:
    """A function's or class's own name, else its class's."""
    name = getattr(obj, "__name__", None)
    return name if isinstance(name, str) else type(obj).__name__


def _input_ids(token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([list(token_ids)], dtype=torch.int64, device=device)  # [1, L]


def _check_result(owner: str, result: Any, like: torch.Tensor) -> torch.Tensor:
    """``result`` if it can replace ``like`` (a float tensor of its shape, without NaN); else raises."""
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"{owner} returned {type(result).__name__}, not a tensor")
    if tuple(result.shape) != tuple(like.shape):
        raise ValueError(f"{owner} returned shape {tuple(result.shape)}, expected {tuple(like.shape)}")
    if not result.is_floating_point():
        raise TypeError(f"{owner} returned a {result.dtype} tensor, not floating point")
    if bool(torch.isnan(result).any()):
        raise ValueError(f"{owner} returned NaN logits")
    return result.to(device=like.device, dtype=like.dtype)


# ---------------------------------------------------------------------------------------- applying
def apply_request_processors(
    logits: torch.Tensor,
    hooks: Sequence[RequestHooks | None],
    token_ids: Callable[[int], list[int]],
    errors: list[str | None],
) -> None:
    """Each row ``i`` with ``hooks[i]`` processors (and no error yet) through them, in order, in place;
    ``token_ids(i)``: the row's prompt and output. A failure sets ``errors[i]``."""
    for i, row_hooks in enumerate(hooks):
        if row_hooks is None or not row_hooks.logits_processors or errors[i] is not None:
            continue
        input_ids = _input_ids(token_ids(i), logits.device)
        scores = logits[i : i + 1].clone()  # [1, V]
        for k, processor in enumerate(row_hooks.logits_processors):
            owner = f"logits_processor[{k}] ({_name(processor)})"
            try:
                scores = _check_result(owner, processor(input_ids, scores), scores)
            except Exception as exc:  # NOTE: the user's code fails its own request, not the batch.
                errors[i] = f"{owner} failed: {exc!r}"
                break
        else:
            logits[i] = scores[0]


def apply_server_processors(
    logits: torch.Tensor,
    processors: Sequence[tuple[str, BatchedLogitsProcessor]],
    rows: Sequence[ProcessorRow | None],
    errors: list[str | None],
) -> None:
    """Every named server processor, in order, over the rows that have a ``ProcessorRow`` (and no error
    yet), in place. A failure sets ``errors`` for the rows that fail alone."""
    for name, processor in processors:
        idx = [i for i, row in enumerate(rows) if row is not None and errors[i] is None]
        if not idx:
            return
        batch = [row for i in idx if (row := rows[i]) is not None]
        sel = torch.tensor(idx, dtype=torch.int64, device=logits.device)
        sub = logits.index_select(0, sel)  # [len(idx), V]
        owner = f"logits processor {name}"
        try:
            logits.index_copy_(0, sel, _check_result(owner, processor(batch, sub), sub))
        except Exception:  # NOTE: find the rows that fail alone; the others keep their own result.
            for i, row in zip(idx, batch, strict=True):
                one = logits[i : i + 1].clone()  # [1, V]
                try:
                    logits[i] = _check_result(owner, processor([row], one), one)[0]
                except Exception as exc:
                    errors[i] = f"{owner} failed: {exc!r}"
