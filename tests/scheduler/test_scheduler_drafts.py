"""Speculative decoding in the scheduler: a decoding request's drafts join its chunk (a verify chunk), the
accepted ones keep their KV, the rejected ones are rolled back, and the prefix cache only ever holds
accepted tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcache.errors import IntegrityError
from scheduler import FinishReason, Request, Scheduler
from tests.scheduler.conftest import MakeScheduler

Req = Callable[..., Request]


def decoding(
    make: MakeScheduler, req: Req, prompt_len: int = 6, max_new: int = 16, **kw: object
) -> Scheduler:
    """A scheduler whose one request "a" has prefilled its prompt and sampled its first token (7)."""
    s = make(**kw)
    s.add_request(req("a", prompt_len, max_new=max_new))
    s.update(s.schedule(), {"a": 7}, {})
    return s


def test_drafts_join_the_chunk_of_a_decoding_request(make: MakeScheduler, req: Req) -> None:
    s = decoding(make, req)
    a = s.get_request("a")
    assert a is not None
    a.draft_ids = [8, 9, 10]
    (chunk,) = s.schedule().requests
    assert (chunk.start, chunk.num_tokens, chunk.draft_ids) == (6, 4, (8, 9, 10))
    assert chunk.token_ids == [7, 8, 9, 10]
    assert chunk.needs_sample and chunk.num_logits_rows == 4
    assert len(chunk.block_ids) * 4 >= 10  # slots for every draft


@pytest.mark.parametrize(
    ("accepted", "computed"),
    [([11], 7), ([8, 11], 8), ([8, 9, 11], 9), ([8, 9, 10, 11], 10)],
)
def test_accepted_drafts_keep_their_kv_and_rejected_ones_roll_back(
    make: MakeScheduler, req: Req, accepted: list[int], computed: int
) -> None:
    s = decoding(make, req)
    a = s.get_request("a")
    assert a is not None
    a.draft_ids = [8, 9, 10]
    s.update(s.schedule(), {"a": accepted}, {})
    s.check_integrity()
    assert a.output_ids == [7, *accepted]
    assert a.num_computed_tokens == computed  # every token but the last sampled one has its KV
    assert a.draft_ids == []
    assert len(s.block_ids("a")) == -(-computed // 4)  # the rejected drafts' blocks are freed
    (chunk,) = s.schedule().requests  # back to plain decoding: the last token alone
    assert (chunk.start, chunk.num_tokens, chunk.draft_ids) == (computed, 1, ())


def test_tokens_that_do_not_extend_the_drafts_are_refused(make: MakeScheduler, req: Req) -> None:
    s = decoding(make, req)
    a = s.get_request("a")
    assert a is not None
    a.draft_ids = [8, 9]
    with pytest.raises(IntegrityError, match="do not extend its drafts"):
        s.update(s.schedule(), {"a": [8, 5, 11]}, {})


def test_drafts_never_pass_max_new_tokens_or_the_budget(make: MakeScheduler, req: Req) -> None:
    s = decoding(make, req, max_new=4)  # 1 token out, 3 to go: at most 2 drafts then one sampled token
    a = s.get_request("a")
    assert a is not None
    a.draft_ids = [8, 9, 10, 11]
    assert s.schedule().requests[0].draft_ids == (8, 9)

    s = decoding(make, req, max_batch_tokens=6)  # a budget of 3 tokens left once the prompt is in
    a = s.get_request("a")
    assert a is not None
    s.add_request(req("b", 3, start=100))
    a.draft_ids = [8, 9, 10, 11]
    chunks = {c.request.request_id: c for c in s.schedule().requests}
    assert chunks["a"].draft_ids == (8, 9, 10, 11)  # a running request's drafts come before admissions
    assert chunks["b"].num_tokens == 1


def test_drafts_are_dropped_before_anyone_is_preempted(make: MakeScheduler, req: Req) -> None:
    s = decoding(make, req, num_blocks=4, prompt_len=7, max_new=8)  # 2 of the 4 blocks held
    a = s.get_request("a")
    assert a is not None
    s.add_request(req("c", 8, start=50))  # takes the last 2 blocks
    s.update(s.schedule(), {}, {})
    a.draft_ids = [8, 9, 10, 11]  # a verify chunk would need a fifth block
    batch = s.schedule()
    assert not batch.preempted_ids
    chunk = next(c for c in batch.requests if c.request.request_id == "a")
    assert chunk.draft_ids == () and chunk.num_tokens == 1
    s.check_integrity()


def test_the_prefix_cache_holds_only_accepted_tokens(make: MakeScheduler, req: Req) -> None:
    s = decoding(make, req, prompt_len=3)  # tokens 0 1 2 | 7
    a = s.get_request("a")
    assert a is not None
    a.draft_ids = [8, 9, 10, 11, 12]  # would fill blocks [0 1 2 7] [8 9 10 11]
    s.update(s.schedule(), {"a": [8, 9, 10, 21]}, {})  # 11 rejected: its slot holds a stale KV
    s.update(s.schedule(), {"a": [22]}, {})  # 21 computed over it: [8 9 10 21] is full
    s.check_integrity()
    s.finish_request("a", FinishReason.STOP)
    accepted = [0, 1, 2, 7, 8, 9, 10, 21, 22, 0]
    rejected = [0, 1, 2, 7, 8, 9, 10, 11, 12, 0]
    assert s.kv_manager.get_computed_blocks("x", accepted).num_tokens == 8
    assert s.kv_manager.get_computed_blocks("y", rejected).num_tokens == 4


def test_a_finished_request_in_a_verify_chunk_frees_everything(make: MakeScheduler, req: Req) -> None:
    s = decoding(make, req)
    a = s.get_request("a")
    assert a is not None
    a.draft_ids = [8, 9, 10]
    s.update(s.schedule(), {"a": [8, 9]}, {"a": FinishReason.STOP})  # a stop token among the drafts
    s.check_integrity()
    assert a.output_ids == [7, 8, 9] and a.is_finished
    assert s.kv_manager.request_ids == set()


def test_preemption_drops_drafts(make: MakeScheduler, req: Req) -> None:
    s = decoding(make, req)
    a = s.get_request("a")
    assert a is not None
    a.draft_ids = [8, 9]
    s._preempt(a, s.schedule())  # noqa: SLF001 - the preemption path itself
    assert a.draft_ids == [] and a.num_computed_tokens == 0
