"""A request's sequences: fan-out of n samples at sequence 0's first sample, siblings failing with an
unforked sequence 0, the samples a cancelled group never started, and when the group is done."""

from __future__ import annotations

import queue

from engine.generation.config import GenerationConfig
from engine.generation.sampler import SampledToken
from engine.request_handle import SyncSink
from engine.sequence_group import SequenceGroup


class Decoder:
    def decode(self, ids: list[int], /, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def group(n: int) -> SequenceGroup:
    config = GenerationConfig(num_return_sequences=n, do_sample=True, max_new_tokens=4)
    sink = SyncSink("r", queue.Queue(), n)
    return SequenceGroup("r", [1, 2, 3], config, 4, sink, False, False, Decoder(), (0,))


def token(token_id: int) -> SampledToken:
    return SampledToken(token_id=token_id, logprob=None)


def test_first_sample_fans_out_to_n_rows_once() -> None:
    g = group(3)
    first = g.start()
    assert first.scheduler_id == "r#0" and g.sequences == [first]
    sampling = g.sampling(first)
    assert [s.index for s in sampling] == [0, 1, 2]
    pairs = g.fan_out([token(5), token(6), token(7)])
    assert [(s.index, t.token_id) for s, t in pairs] == [(1, 6), (2, 7)]
    assert g.sampling(first) == [first]  # forked: sequence 0 samples alone from now on
    request = g.new_request(pairs[0][0], output_ids=[6])
    assert (request.request_id, request.output_ids, request.payload) == ("r#1", [6], pairs[0][0])


def test_single_sample_never_fans_out() -> None:
    g = group(1)
    first = g.start()
    assert g.sampling(first) == [first]
    assert g.unforked_siblings(first) == []


def test_unforked_siblings_fail_with_sequence_0_once() -> None:
    g = group(3)
    first = g.start()
    assert [s.index for s in g.unforked_siblings(first)] == [1, 2]
    assert g.forked and g.unforked_siblings(first) == []


def test_a_group_ended_before_its_fan_out_still_owes_every_sample() -> None:
    g = group(3)
    g.start()
    missing = g.never_started()
    assert [(s.index, s.finished) for s in missing] == [(1, True), (2, True)]
    assert g.never_started() == []
    assert [g.on_final_output() for _ in range(3)] == [False, False, True]
