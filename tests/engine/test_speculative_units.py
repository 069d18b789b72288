"""Speculative decoding's parts on scripted inputs: the n-gram proposer, the draft-length schedule, the
configs, and the verifier against the definition of speculative sampling (Leviathan et al. 2023: the output
follows the target distribution; a draft d is accepted with probability p(d))."""

from __future__ import annotations

import math
import queue
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.sampler import Sampler
from engine.generation.speculation import DraftLength, Speculation
from engine.output_processor import OutputProcessor, StepTokens
from engine.request_handle import SyncSink
from engine.sequence_group import Sequence, SequenceGroup
from engine.speculative.config import SpeculativeConfig, speculation_for
from engine.speculative.ngram import NgramIndex, word_start_ids
from engine.speculative.speculator import SpecDecodeStats, Speculator
from engine.speculative.verifier import VerifyRun, num_accepted, verify_drafts
from scheduler.request import Request


# ---------------------------------------------------------------------------------------- n-gram
def propose_ngram(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    index = NgramIndex(min_n, max_n)
    index.update(token_ids, [])
    return index.propose(num_tokens)


class SearchedCopy:
    """The rule, by its definition: a search of the whole sequence at every proposal, and the copy cursor
    walked along the output's new tokens from where the last drafts were copied."""

    def __init__(self, min_n: int, max_n: int, word_starts: set[int] | None = None) -> None:
        self.min_n, self.max_n, self.word_starts = min_n, max_n, word_starts
        self.ids: list[int] = []
        self.cursor: int | None = None
        self.source: int | None = None

    def grow(self, new_ids: list[int]) -> None:
        source = self.source if self.source is not None else self.cursor
        self.source = None
        first_new = len(self.ids)
        self.ids += new_ids
        if source is None:
            return
        for position in range(first_new, len(self.ids)):
            if source < position and self.ids[source] == self.ids[position]:
                source += 1
            else:
                break
        self.cursor = source

    def propose(self, num_tokens: int) -> list[int]:
        ids, length = self.ids, len(self.ids)
        if num_tokens < 1:
            return []
        start = None
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            continuations = [s + n for s in range(length - n) if ids[s : s + n] == ids[length - n :]]
            if continuations:
                near = [c for c in continuations if self.cursor is not None and 0 <= c - self.cursor <= 64]
                start = near[0] if near else continuations[-1]
                break
        if start is None and self.cursor is not None:
            words = [
                p
                for p in range(self.cursor + 1, length)
                if self.word_starts is None or ids[p] in self.word_starts
            ]
            start = words[0] if words else None
        if start is None:
            return []
        self.source = start
        return [ids[start + i % (length - start)] for i in range(num_tokens)]


def test_ngram_index_kept_as_the_sequence_grows_proposes_what_a_search_finds() -> None:
    rng = random.Random(3)
    for trial in range(300):
        vocab = rng.randint(2, 6)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        output: list[int] = []
        min_n = rng.randint(1, 3)
        words = {t for t in range(vocab) if rng.random() < 0.5} if rng.random() < 0.5 else None
        index = NgramIndex(min_n, rng.randint(min_n, 4), words)
        reference = SearchedCopy(index.min_n, index.max_n, words)
        reference.grow(prompt)
        for _ in range(rng.randint(1, 10)):  # steps: the drafts' accepted prefix, then the target's token
            k = rng.randint(0, 6)
            index.update(prompt, output)
            drafts = index.propose(k)
            assert drafts == reference.propose(k), (trial, prompt, output)
            new = drafts[: rng.randint(0, len(drafts))] + [rng.randrange(vocab)]
            output += new
            reference.grow(new)


def test_ngram_takes_the_longest_suffix_and_its_latest_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # suffix (5 6 7) matches at 0 only: drafts follow it
    assert propose_ngram(tokens, 1, 3, 3) == [8, 9, 1]
    # with n <= 2, (6 7) matches at 1 and 6: the latest wins
    assert propose_ngram(tokens, 1, 2, 3) == [2, 3, 5]
    assert propose_ngram(tokens, 1, 3, 1) == [8]


def test_ngram_follows_an_edit_of_its_prompt_where_it_copies_from() -> None:
    """Fixing typos: after each changed word the copy resumes at the source's next word, and a common word
    continues the copy where it stands, not at the word's latest occurrence."""
    words = "fix : the comittee met on the tuesday and the budjet . answer : the committee met on the".split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + ["tuesday", "and"]))}
    ids = [vocab[w] for w in words]
    prompt, output = ids[:14], ids[14:]  # the output so far: "the committee met on the"
    index = NgramIndex(1, 2)
    index.update(prompt, output[:1])  # "the"
    assert index.propose(3) == [vocab["comittee"], vocab["met"], vocab["on"]]  # the copy starts at 3
    index.update(prompt, output[:2])  # the target changed "comittee" to "committee": the cursor stays at 3
    assert index.cursor == 3
    assert index.propose(3) == [vocab["met"], vocab["on"], vocab["the"]]  # the copy resumes at the next word
    index.update(prompt, output)  # the drafts accepted, then "the" (position 6 in the source)
    assert index.cursor == 7
    # "on the" occurs once: its continuation. Then one more step with only "the" to go by: its occurrences
    # at 2, 6, 9 and in the output, and the copy goes on at the cursor's (6 -> 7 "tuesday")
    assert index.propose(2) == [vocab["tuesday"], vocab["and"]]
    index.update(prompt, output + [vocab["tuesday"], vocab["and"], vocab["the"]])
    assert index.cursor == 10
    latest_only = NgramIndex(1, 1)
    latest_only.update(prompt, output + [vocab["tuesday"], vocab["and"], vocab["the"]])
    assert latest_only.propose(1) == [vocab["tuesday"]]  # without a cursor: the latest "the" (the output's)
    index.min_n = index.max_n = 1
    assert index.propose(1) == [vocab["budjet"]]  # with it: the "the" at the cursor


def test_word_starts_are_the_tokens_after_a_space_or_line_break(smollm2_reader: Any) -> None:
    from engine.loader.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_reader)
    starts = word_start_ids(tokenizer)
    (the,) = tokenizer.encode(" the", add_special_tokens=False)
    (bare,) = tokenizer.encode("the", add_special_tokens=False)
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    assert the in starts and newline in starts and bare not in starts
    assert word_start_ids(tokenizer) is starts  # made once per tokenizer
    # SentencePiece: a piece's "\u2581" is its space, which decoding the piece alone drops
    pieces = ["\u2581the", "the", "<0x0A>"]
    spm = SimpleNamespace(
        vocab_size=3, convert_ids_to_tokens=lambda ids: [pieces[i] for i in ids], decode=lambda ids: "the"
    )
    assert word_start_ids(spm) == {0}


def test_ngram_gives_nothing_without_a_match() -> None:
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []
    assert propose_ngram([1, 2, 3, 4], 2, 3, 4) == []
    assert propose_ngram([7], 1, 3, 4) == []
    assert propose_ngram([1, 2, 1, 2], 1, 3, 0) == []
    assert propose_ngram([1, 2, 9, 1, 2], 3, 3, 4) == []  # min_n: shorter matches do not count


def test_ngram_match_that_reaches_the_end_continues_periodically() -> None:
    # (1 2 3) matches at 0; its continuation runs into the end after 3 tokens: the loop goes on
    assert propose_ngram([1, 2, 3, 1, 2, 3], 1, 3, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert propose_ngram([7, 7], 1, 3, 4) == [7, 7, 7, 7]  # a period of one token
    # (4 5) matches two tokens before the suffix: a period of 2
    assert propose_ngram([9, 4, 5, 4, 5], 2, 2, 5) == [4, 5, 4, 5, 4]
    # a match whose continuation is long enough is not extended
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2], 2, 2, 3) == [3, 4, 5]


def decoding(request_id: str, prompt: list[int]) -> Request:
    """A request that decodes with prompt lookup (n-grams of 1-2 tokens, 3 drafts), its prompt computed."""
    group = SimpleNamespace(speculation=Speculation("ngram", 3, 1, 2, "constant"))
    payload = SimpleNamespace(group=group, draft_length=None, gen=SimpleNamespace(grammar=None))
    req = Request(request_id, prompt, max_new_tokens=32, payload=payload)
    req.num_computed_tokens = len(prompt) - 1
    return req


def test_speculator_follows_each_request_as_it_grows_and_not_another_of_the_same_id() -> None:
    speculator = Speculator()
    first = decoding("a", [1, 2, 3, 1, 2])
    speculator.propose([first])
    assert first.draft_ids == [3, 1, 2]
    first.output_ids += [3, 9, 8]  # a verify step accepted 3, then the target said 9, then 8
    first.num_computed_tokens += 3
    speculator.propose([first])
    # (9 8) and 8 never came before: the copy resumes after the source token the output changed
    # (position 3, a 1 where the output said 9): 2, then the sequence's own continuation from there
    assert first.draft_ids == [2, 3, 9]
    first.output_ids += [5]  # nothing accepted: 5 is the target's
    first.num_computed_tokens += 1
    speculator.propose([first])
    # the output did not follow the resumed copy (from position 4) either: the cursor is there now, and
    # the copy resumes one token on
    assert first.draft_ids == [3, 9, 8]
    again = decoding("a", [7, 8, 7])  # a new request under the same id: its own tokens only
    speculator.propose([again])
    assert again.draft_ids == [8, 7, 8]


# ---------------------------------------------------------------------------------------- schedule
def test_heuristic_draft_length_follows_acceptance_within_its_maximum() -> None:
    length = DraftLength(Speculation("ngram", 5))
    assert length.value == 5
    length.update(5, 2)
    length.update(4, 0)
    assert length.value == 3
    length.update(3, 3)
    assert length.value == 5  # +2, never past the maximum
    for _ in range(10):
        length.update(length.value, 0)
    assert length.value == 1
    constant = DraftLength(Speculation("ngram", 5, schedule="constant"))
    constant.update(5, 0)
    assert constant.value == 5


def test_stats_count_drafts_and_acceptance_by_position() -> None:
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(3, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 7, 2)
    assert stats.accepted_per_position[:3] == [1, 1, 0]
    assert stats.mean_acceptance_length == 2.0


# ---------------------------------------------------------------------------------------- configs
def test_request_speculation_over_the_servers() -> None:
    ngram = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4}
    )
    assert speculation_for(GenerationConfig(), None) is None
    # prompt lookup drafts its most tokens every step unless asked otherwise; models that draft adapt
    assert speculation_for(GenerationConfig(), ngram) == Speculation("ngram", 6, 1, 4, "constant")
    mine = GenerationConfig(prompt_lookup_num_tokens=3, max_matching_ngram_size=2)
    assert speculation_for(mine, None) == Speculation("ngram", 3, 1, 2, "constant")
    adapting = GenerationConfig(num_assistant_tokens_schedule="heuristic")
    assert speculation_for(adapting, ngram) == Speculation("ngram", 6, 1, 4, "heuristic")
    heuristic_server = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_assistant_tokens_schedule": "heuristic"}
    )
    assert speculation_for(GenerationConfig(), heuristic_server).schedule == "heuristic"
    assert speculation_for(GenerationConfig(prompt_lookup_num_tokens=0), ngram) is None
    fewer = GenerationConfig(num_assistant_tokens=2, num_assistant_tokens_schedule="constant")
    assert speculation_for(fewer, ngram) == Speculation("ngram", 2, 1, 4, "constant")
    assert speculation_for(GenerationConfig(dola_layers="high"), ngram) is None
    early = GenerationConfig(assistant_early_exit=6, assistant_confidence_threshold=0.3)
    assert speculation_for(early, None) == Speculation(
        "early_exit", 4, num_layers=6, confidence_threshold=0.3
    )
    server = SpeculativeConfig.from_dict(
        {"method": "early_exit", "num_layers": 9, "num_speculative_tokens": 3}
    )
    assert speculation_for(GenerationConfig(), server) == Speculation("early_exit", 3, 1, 3, num_layers=9)
    with pytest.raises(GenerationConfigError, match="cannot be combined"):
        GenerationConfig(assistant_early_exit=6, prompt_lookup_num_tokens=2).validate()
    with pytest.raises(GenerationConfigError, match="does not speculate"):
        speculation_for(GenerationConfig(num_assistant_tokens=2), None)
    with pytest.raises(GenerationConfigError, match="num_assistant_tokens_schedule"):
        GenerationConfig(num_assistant_tokens_schedule="sometimes").validate()


# ---------------------------------------------------------------------------------------- verifier
class Decoder:
    def decode(self, ids: list[int], /, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


VOCAB = 5


def sequences(num: int, config: GenerationConfig, name: str = "r") -> list[Sequence]:
    out = []
    for i in range(num):
        cfg = config.merged(seed=i)
        group = SequenceGroup(
            f"{name}{i}",
            [1, 2],
            cfg,
            8,
            SyncSink(f"{name}{i}", queue.Queue(), 1),
            False,
            False,
            Decoder(),
            (),
        )
        out.append(group.start())
    return out


def first_tokens(
    sampler: Sampler, outputs: OutputProcessor, seqs: list[Sequence], logits: torch.Tensor
) -> StepTokens:
    """What the loop does for a verify chunk's first row: sample it with everyone, accept it."""
    step = StepTokens(now=0.0)
    rows = [s.gen.sampling_row() for s in seqs]
    for seq, tok in zip(seqs, sampler.sample(logits.expand(len(seqs), -1).contiguous(), rows), strict=True):
        assert outputs.accept(seq, tok, 0.0) is None
        step.new_tokens[seq.scheduler_id] = [tok.token_id]
        step.accepted.append(seq)
    return step


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


CHI2_4DF_P001 = 18.47  # df = 4 (five tokens), p = 0.001


def test_speculative_sampling_follows_the_target_distribution() -> None:
    num = 4000
    sampler = Sampler(VOCAB)
    outputs = OutputProcessor()
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.05, 0.15, 0.2, 0.3])
    draft = (1, 4)  # d1 = 1 (p0 = 0.4), d2 = 4 (p1 = 0.3)
    seqs = sequences(num, GenerationConfig(do_sample=True, top_k=0, max_new_tokens=8))
    step = first_tokens(sampler, outputs, seqs, p0.log().unsqueeze(0))
    after = torch.stack([p1.log(), p0.log()])  # the rows after d1 and after d2 (the bonus)
    runs = [VerifyRun(s, draft, after) for s in seqs]
    verify_drafts(sampler, outputs, runs, step)

    first = [step.new_tokens[s.scheduler_id][0] for s in seqs]
    counts0 = [first.count(t) for t in range(VOCAB)]
    assert chi_square(counts0, p0.tolist()) < CHI2_4DF_P001
    accepted = [s for s in seqs if step.new_tokens[s.scheduler_id][0] == draft[0]]
    second = [step.new_tokens[s.scheduler_id][1] for s in accepted]
    assert chi_square([second.count(t) for t in range(VOCAB)], p1.tolist()) < CHI2_4DF_P001
    # acceptance of d1 is p0(d1): 0.4, within 4 standard deviations
    rate = len(accepted) / num
    assert abs(rate - 0.4) < 4 * math.sqrt(0.4 * 0.6 / num)
    # a run is read only past matched drafts: rejected at d1 -> one token; at d2 -> two; both -> three
    for s, run in zip(seqs, runs, strict=True):
        tokens = step.new_tokens[s.scheduler_id]
        n = num_accepted(run, step)
        assert len(tokens) == min(n + 1, 3) and tokens[:n] == list(draft[:n])


def test_greedy_verification_stops_at_the_first_mismatch_and_takes_the_bonus() -> None:
    sampler = Sampler(VOCAB)
    outputs = OutputProcessor()
    logits = torch.eye(VOCAB)  # row i: argmax i
    seqs = sequences(3, GenerationConfig(max_new_tokens=8))
    step = first_tokens(sampler, outputs, seqs, logits[2:3])  # every sequence's first token: 2
    runs = [
        VerifyRun(seqs[0], (2, 3, 4), logits[[3, 4, 0]]),  # every draft accepted, bonus 0
        VerifyRun(seqs[1], (2, 1, 4), logits[[3, 4, 0]]),  # 1 rejected: 3 instead
        VerifyRun(seqs[2], (0, 3), logits[[3, 4]]),  # the first draft rejected: the first token stands
    ]
    verify_drafts(sampler, outputs, runs, step)
    assert [step.new_tokens[s.scheduler_id] for s in seqs] == [[2, 3, 4, 0], [2, 3], [2]]
    assert [num_accepted(r, step) for r in runs] == [3, 1, 0]


def test_greedy_rows_with_a_processor_see_the_drafts_accepted_before_them() -> None:
    # A plain greedy row reads its logits alone (its rows are chosen at once); a repetition penalty reads
    # the tokens accepted so far, so its row after the draft 4 must see that 4 and take 0 instead.
    sampler = Sampler(VOCAB)
    outputs = OutputProcessor()
    (plain,) = sequences(1, GenerationConfig(max_new_tokens=8))
    (penalised,) = sequences(1, GenerationConfig(max_new_tokens=8, repetition_penalty=2.0), name="p")
    step = first_tokens(sampler, outputs, [plain, penalised], torch.tensor([[0.0, 0, 0, 5, 0]]))
    rows = torch.tensor([[0.0, 0, 0, 0, 5], [1.5, 0, 0, 0, 2], [0, 0, 1, 0, 0]])  # after 3, after 4, bonus
    verify_drafts(sampler, outputs, [VerifyRun(s, (3, 4, 4), rows) for s in (plain, penalised)], step)
    assert step.new_tokens[plain.scheduler_id] == [3, 4, 4, 2]
    assert step.new_tokens[penalised.scheduler_id] == [3, 4, 0]


def test_a_stop_token_inside_the_run_ends_it_there() -> None:
    sampler = Sampler(VOCAB)
    outputs = OutputProcessor()
    logits = torch.eye(VOCAB)
    (seq,) = sequences(1, GenerationConfig(max_new_tokens=8, eos_token_id=3))
    step = first_tokens(sampler, outputs, [seq], logits[2:3])
    verify_drafts(sampler, outputs, [VerifyRun(seq, (2, 3, 4), logits[[3, 4, 0]])], step)
    assert step.new_tokens[seq.scheduler_id] == [2, 3]
    assert step.finished[seq.scheduler_id].value == "stop"
