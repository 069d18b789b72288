"""Contrastive search in the continuous batch (engine/contrastive_group.py, engine/generation/contrastive.py)
against the algorithm's definition written here as a plain loop over transformers' model (full forwards with
``output_hidden_states``, no cache; transformers 5.x moved ``_contrastive_search`` to its hub): on a tiny
random Llama saved as a folder, alone, inside a batch of greedy and sampled requests, and under preemption
with a tiny KV cache, the scheduler's integrity checked after every step and no block left behind; on the
default model; the scoring on scripted tensors; the refusals naming their field, over HTTP too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
from beam_harness import PROMPTS, checked_every_step, save_tiny
from torch_threads import one_torch_thread
from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from engine.engine import CacheOptions, Engine
from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.contrastive import choose, degeneration_penalty, top_candidates
from engine.manager import ContinuousBatchingManager
from engine.outputs import GenerationOutput, RequestStatus

MAX_NEW = 10


# ---------------------------------------------------------------- the definition, on transformers' model
@torch.no_grad()
@one_torch_thread()  # see tests/torch_threads.py
def reference(
    model: Any,
    prompt: list[int],
    penalty_alpha: float,
    top_k: int,
    max_new: int = MAX_NEW,
    eos: int | None = None,
    **processors: Any,
) -> list[int]:
    """Su et al.'s contrastive search as transformers 4.x runs it: the processed logits' top_k, each
    candidate's last hidden state (``hidden_states[-1]``) against every earlier position's, the best
    ``(1 - alpha) * p - alpha * max cos``; the chosen candidate's logits give the next distribution. Ends
    after ``max_new`` tokens or at ``eos``."""
    chain = LogitsProcessorList()
    if "repetition_penalty" in processors:
        chain.append(RepetitionPenaltyLogitsProcessor(processors["repetition_penalty"]))
    if "no_repeat_ngram_size" in processors:
        chain.append(NoRepeatNGramLogitsProcessor(processors["no_repeat_ngram_size"]))
    ids = torch.tensor([prompt])
    out = model(ids, output_hidden_states=True)
    context = out.hidden_states[-1][0]  # [len, hidden]
    logits = out.logits[0, -1].float()
    tokens: list[int] = []
    for _ in range(max_new):
        probs = torch.softmax(chain(ids, logits[None].clone())[0], dim=-1)
        top_probs, top_ids = probs.topk(top_k)
        rows = torch.cat([ids.repeat(top_k, 1), top_ids[:, None]], dim=1)  # every candidate as the next token
        cand = model(rows, output_hidden_states=True)
        hidden = cand.hidden_states[-1][:, -1]  # [k, hidden]
        cosine = (context / context.norm(dim=-1, keepdim=True)) @ (
            hidden / hidden.norm(dim=-1, keepdim=True)
        ).T
        scores = (1 - penalty_alpha) * top_probs - penalty_alpha * cosine.max(dim=0).values
        best = int(scores.argmax())
        tokens.append(int(top_ids[best]))
        ids = rows[best : best + 1]
        context = torch.cat([context, hidden[best : best + 1]])
        logits = cand.logits[best, -1].float()
        if tokens[-1] == eos:
            break
    return tokens


# ---------------------------------------------------------------- the scoring on scripted tensors
def test_scoring_on_scripted_tensors() -> None:
    context = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    hidden = torch.tensor([[3.0, 0.0], [1.0, 1.0], [0.0, -1.0]])
    assert degeneration_penalty(context, hidden).tolist() == pytest.approx([1.0, 2**-0.5, 0.0])
    candidates = top_candidates(torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25])), 3)
    assert candidates.token_ids == [1, 3, 2]
    assert candidates.probs.tolist() == pytest.approx([0.5, 0.25, 0.15])
    # scores 0.5*(0.5, 0.25, 0.15) - 0.5*(1, 0.707, 0): the repeated direction loses to the new one
    assert choose(candidates, context, hidden, alpha=0.5) == 2
    assert choose(candidates, context, hidden, alpha=0.0) == 0  # no penalty: greedy
    assert choose(candidates, context, hidden, alpha=1.0) == 2  # penalty only
    logprobs = top_candidates(torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25])), 2, top_logprobs=1).logprobs
    assert logprobs is not None and [lp.token_id for lp in logprobs] == [1, 3]
    assert logprobs[1].logprob == pytest.approx(float(torch.log(torch.tensor(0.25))))
    assert logprobs[0].top == [(1, pytest.approx(float(torch.log(torch.tensor(0.5)))))]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(do_sample=True), "do_sample"),
        (dict(num_beams=2), "num_beams"),
        (dict(num_return_sequences=2), "num_return_sequences"),
        (dict(dola_layers="high"), "dola_layers"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(penalty_alpha=1.5), "penalty_alpha"),
        (dict(penalty_alpha="a lot"), "penalty_alpha"),
    ],
)
def test_what_contrastive_search_cannot_honour_names_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(GenerationConfigError, match=field):
        GenerationConfig(**{"penalty_alpha": 0.6, "top_k": 4, **options})


def test_alpha_zero_or_top_k_one_is_not_contrastive() -> None:
    assert GenerationConfig(penalty_alpha=0.6, top_k=4).is_contrastive_search
    assert GenerationConfig(penalty_alpha=0.6).is_contrastive_search  # transformers' default top_k, 50
    assert not GenerationConfig(penalty_alpha=0.0, top_k=4).is_contrastive_search
    assert not GenerationConfig(penalty_alpha=0.6, top_k=1, do_sample=True).is_contrastive_search


# ---------------------------------------------------------------- a tiny random Llama
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("contrastive") / "llama", "LlamaConfig", seed=5)


@pytest.fixture(scope="module")
def model(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(folder: Path) -> Engine:
    return Engine.from_pretrained(str(folder), device="cpu", dtype="float32", num_blocks=256)


SEARCHES: list[dict[str, Any]] = [
    dict(penalty_alpha=0.6, top_k=4),
    dict(penalty_alpha=0.3, top_k=6, repetition_penalty=1.3),
    dict(penalty_alpha=0.8, top_k=3, no_repeat_ngram_size=2),
]


def run_all(manager: ContinuousBatchingManager, requests: list[dict[str, Any]]) -> list[GenerationOutput]:
    """Every request (``prompt`` + options) added at once, check_integrity after every step; the final
    outputs in order, every block free at the end."""
    errors = checked_every_step(manager)
    manager.start()
    try:
        ids = [
            manager.add_request(
                r["prompt"], **{"max_new_tokens": MAX_NEW, **{k: v for k, v in r.items() if k != "prompt"}}
            )
            for r in requests
        ]
        finals: dict[str, GenerationOutput] = {}
        while len(finals) < len(ids):
            out = manager.get_result(timeout=60)
            assert out is not None, "the engine stopped answering"
            if out.is_finished:
                assert out.status is RequestStatus.FINISHED, out.error
                finals[out.request_id] = out
    finally:
        manager.stop(timeout=30)
    assert errors == []
    manager.check_integrity()
    assert manager.scheduler.kv_manager.num_free_blocks == manager.scheduler.num_blocks
    return [finals[rid] for rid in ids]


@pytest.fixture(scope="module")
def expected(model: Any) -> list[list[int]]:
    return [reference(model, prompt, **search) for prompt, search in zip(PROMPTS, SEARCHES, strict=True)]


def test_alone_and_in_a_batch_it_is_the_definition(engine: Engine, expected: list[list[int]]) -> None:
    alone = [
        run_all(
            engine.init_continuous_batching(), [dict(prompt=p, output_logprobs=True, top_logprobs=2, **s)]
        )[0]
        for p, s in zip(PROMPTS, SEARCHES, strict=True)
    ]
    assert [o.generated_ids for o in alone] == expected
    for out in alone:  # each chosen token's log-probability in the processed distribution, and the best two
        assert out.logprobs is not None and [lp.token_id for lp in out.logprobs] == out.generated_ids
        assert all(lp.logprob <= lp.top[0][1] and len(lp.top) == 2 for lp in out.logprobs)
    others = [
        dict(prompt=[5, 6, 7, 8], do_sample=False),
        dict(prompt=list(range(100, 130)), do_sample=True, seed=7),
        dict(prompt=[9, 10], do_sample=False, max_new_tokens=3),
    ]
    others_alone = run_all(engine.init_continuous_batching(), others)
    mixed = run_all(
        engine.init_continuous_batching(),
        [others[0], *(dict(prompt=p, **s) for p, s in zip(PROMPTS, SEARCHES, strict=True)), *others[1:]],
    )
    assert [o.generated_ids for o in mixed[1:4]] == expected
    assert [o.generated_ids for o in [mixed[0], *mixed[4:]]] == [o.generated_ids for o in others_alone]


def test_under_preemption_with_a_tiny_cache(engine: Engine, expected: list[list[int]]) -> None:
    small = Engine(engine.loaded, CacheOptions(num_blocks=24, block_size=4, max_batch_tokens=32), "small")
    manager = small.init_continuous_batching(safety_margin=0.0)
    searches = [dict(prompt=p, **s) for p, s in zip(PROMPTS[:2], SEARCHES[:2], strict=True)]
    outputs = run_all(manager, [*searches, *searches, dict(prompt=[30, 31, 32, 33, 34], ignore_eos=True)])
    assert manager.scheduler.num_preemptions > 0
    assert [o.generated_ids for o in outputs[:4]] == expected[:2] * 2


# ---------------------------------------------------------------- the default model, over HTTP
def test_on_the_default_model_over_http_it_is_the_definition(
    http: httpx.Client, oracle_model: Any, oracle_tokenizer: Any
) -> None:
    """The session's live server (the default model, float32 on the CPU) against the definition on
    transformers' model, the prompt sent as token ids; it ends at the model's EOS."""
    prompt = oracle_tokenizer.encode("The capital of France is")
    search = dict(penalty_alpha=0.6, top_k=4)
    resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **search})
    assert resp.status_code == 200, resp.text
    expected = reference(oracle_model, prompt, max_new=8, eos=oracle_model.config.eos_token_id, **search)
    choice = resp.json()["choices"][0]
    assert choice["text"] == oracle_tokenizer.decode(expected, skip_special_tokens=True)
    assert choice["finish_reason"] == (
        "stop" if expected[-1] == oracle_model.config.eos_token_id else "length"
    )
    greedy = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert greedy.json()["choices"][0]["text"] != choice["text"]  # the penalty changed the choices


def test_penalty_alpha_over_http(http: httpx.Client) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 6, "penalty_alpha": 0.6, "top_k": 4}
    first = http.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    text = first.json()["choices"][0]["text"]
    assert text
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = [
            line[6:] for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    streamed = "".join(c["choices"][0]["text"] for c in map(json.loads, chunks) if c["choices"])
    assert streamed == text  # deterministic, streamed token by token
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "penalty_alpha": 0.5,
        "top_k": 3,
    }
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    for bad, param in (
        ({"penalty_alpha": 1.5}, "penalty_alpha"),
        ({"temperature": 0.7}, "temperature"),
        ({"n": 2}, "n"),
        ({"dola_layers": "high"}, "dola_layers"),
    ):
        resp = http.post("/v1/completions", json={**body, **bad})
        assert resp.status_code == 400, resp.text
        assert param in (resp.json()["error"]["param"] or ""), resp.text


def test_generate_batch_streaming_and_cancel(engine: Engine, expected: list[list[int]]) -> None:
    config = GenerationConfig(max_new_tokens=MAX_NEW, **SEARCHES[0])
    result = engine.generate_batch([PROMPTS[0]], generation_config=config, progress_bar=False)
    assert result["batch_req_0"].generated_ids == expected[0]
    manager = engine.init_continuous_batching()
    errors = checked_every_step(manager)
    manager.start()
    try:  # streamed token by token; a second request cancelled after its first token
        streamed = manager.add_request(PROMPTS[0], generation_config=config, streaming=True)
        cancelled = manager.add_request(PROMPTS[1], streaming=True, max_new_tokens=200, **SEARCHES[1])
        deltas: list[int] = []
        finals: dict[str, GenerationOutput] = {}
        while len(finals) < 2:
            out = manager.get_result(timeout=60)
            assert out is not None
            if out.request_id == streamed:
                deltas += out.delta_ids
            elif not out.is_finished:
                manager.cancel_request(cancelled)
            if out.is_finished:
                finals[out.request_id] = out
    finally:
        manager.stop(timeout=30)
    assert errors == []
    assert deltas == expected[0] == finals[streamed].generated_ids
    assert finals[cancelled].status is RequestStatus.CANCELLED
    manager.check_integrity()
    assert manager.scheduler.kv_manager.num_free_blocks == manager.scheduler.num_blocks


def test_refused_where_it_cannot_run(engine: Engine, folder: Path) -> None:
    few = Engine(engine.loaded, CacheOptions(num_blocks=64, max_num_seqs=4), "few").init_continuous_batching()
    hf = Engine.from_pretrained(
        str(folder), device="cpu", dtype="float32", num_blocks=64, model_impl="transformers"
    )
    backend = hf.init_continuous_batching()
    for manager in (few, backend):
        manager.start()
    try:
        with pytest.raises(GenerationConfigError, match="top_k"):
            few.add_request([1, 2, 3], max_new_tokens=2, penalty_alpha=0.6, top_k=5)
        with pytest.raises(GenerationConfigError, match="logits_processor"):
            few.add_request(
                [1, 2, 3], max_new_tokens=2, penalty_alpha=0.6, top_k=3, logits_processor=[lambda i, s: s]
            )
        with pytest.raises(GenerationConfigError, match="penalty_alpha"):
            backend.add_request([1, 2, 3], max_new_tokens=2, penalty_alpha=0.6, top_k=3)
    finally:
        for manager in (few, backend):
            manager.stop(timeout=30)
