"""Verification: a speculating sequence's drafts are checked in the step that computes them.

A verify chunk computes the sequence's last known token and its K drafts, so the step's logits hold one
row per position: the row of the last known token gives the first new token (sampled with everyone
else's, engine/loop.py), the row of draft i the token after it. The sequence then goes on exactly as plain
decoding would: at each position the token is chosen from the target's logits with the sequence's own
processors, grammar mask, logprobs and seeded draw (the sampler, as for any row), fed to the sequence
(stopping, stop strings, detokenizing), and the next position is read only while the chosen token equals
the draft there, the first differing token ending the run (and the last row giving a bonus token when every
draft is accepted).

Why this is speculative sampling: the drafts of our proposers are deterministic (a point mass q = δ_d), and
for a point mass the rejection rule of Leviathan et al. and Chen et al. (accept d with probability
min(1, p(d)/q(d)) = p(d), else draw from the residual max(0, p - q), normalized: p without d) is what
drawing t ~ p and accepting d iff t = d does: d is accepted with probability p(d), and a rejection leaves t
distributed as p restricted to t != d. So the output follows the target distribution exactly and, because
the draw at each position is the request's own uniform for that token index (engine/generation/rng.py),
a seeded request gives the same tokens with speculation on or off, alone or batched; greedy requests give
plain decoding's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.generation.sampler import SampledToken, Sampler
from engine.output_processor import Failure, OutputProcessor, StepTokens
from engine.sequence_group import Sequence


@dataclass(frozen=True)
class VerifyRun:
    """One verify chunk's drafts and the logits after each of them (``[len(drafts), vocab]``)."""

    seq: Sequence
    drafts: tuple[int, ...]
    logits: torch.Tensor


def verify_drafts(
    sampler: Sampler, outputs: OutputProcessor, runs: list[VerifyRun], step: StepTokens
) -> None:
    """Extend each run's sequence past the token its first row gave (already in ``step``) while the chosen
    tokens match its drafts; ``step`` gets the accepted tokens, finishes and failures."""
    active = [run for run in runs if _goes_on(run, step, 0)]
    ahead = _chosen_ahead(sampler, active)
    position = 0
    while active:
        drawn = _choose(sampler, [run for run in active if run.seq.scheduler_id not in ahead], position)
        still: list[VerifyRun] = []
        for run in active:
            seq = run.seq
            tok = ahead[seq.scheduler_id][position] if seq.scheduler_id in ahead else drawn[seq.scheduler_id]
            reason = outputs.accept(seq, tok, step.now)
            if isinstance(reason, Failure):
                step.failed.append(reason)
                step.accepted.remove(seq)
                step.new_tokens.pop(seq.scheduler_id, None)
                continue
            step.new_tokens[seq.scheduler_id].append(tok.token_id)
            if reason is not None:
                seq.finished = True
                step.finished[seq.scheduler_id] = reason
            elif _goes_on(run, step, position + 1):
                still.append(run)
        active = still
        position += 1


def _chosen_ahead(sampler: Sampler, runs: list[VerifyRun]) -> dict[str, list[SampledToken]]:
    """The tokens of every row of the runs whose choice reads their logits alone (a greedy row without a
    grammar or a processor, ``Sampler.reads_logits_only``), by scheduler id, in one sampler call: what
    the accepted tokens before a row are does not change its token, so the rows need not wait for them."""
    rows = [(run, run.seq.gen.sampling_row()) for run in runs]
    ahead = [(run, row) for run, row in rows if sampler.reads_logits_only(row)]
    if not ahead:
        return {}
    logits = torch.cat([run.logits for run, _ in ahead]) if len(ahead) > 1 else ahead[0][0].logits
    tokens = sampler.sample(logits, [row for run, row in ahead for _ in run.drafts])  # [sum of K, V]
    chosen: dict[str, list[SampledToken]] = {}
    for run, _ in ahead:
        chosen[run.seq.scheduler_id], tokens = tokens[: len(run.drafts)], tokens[len(run.drafts) :]
    return chosen


def _choose(sampler: Sampler, runs: list[VerifyRun], position: int) -> dict[str, SampledToken]:
    """The token of each run's row at ``position``, chosen with its sequence as it stands (its processors,
    grammar and seeded draw for this token index), by scheduler id."""
    if not runs:
        return {}
    rows = [run.seq.gen.sampling_row() for run in runs]
    logits = (
        torch.stack([run.logits[position] for run in runs])
        if len(runs) > 1
        else runs[0].logits[position : position + 1]
    )  # [R, V]
    return {run.seq.scheduler_id: tok for run, tok in zip(runs, sampler.sample(logits, rows), strict=True)}


def num_accepted(run: VerifyRun, step: StepTokens) -> int:
    """How many of the run's drafts its sequence accepted this step."""
    tokens = step.new_tokens.get(run.seq.scheduler_id, [])
    n = 0
    while n < min(len(tokens), len(run.drafts)) and tokens[n] == run.drafts[n]:
        n += 1
    return n


def _goes_on(run: VerifyRun, step: StepTokens, position: int) -> bool:
    """Whether the token chosen at ``position`` matched its draft and a row after it remains to be read."""
    sid = run.seq.scheduler_id
    tokens = step.new_tokens.get(sid)
    return (
        tokens is not None
        and sid not in step.finished
        and len(tokens) == position + 1
        and position < len(run.drafts)
        and tokens[position] == run.drafts[position]
    )
