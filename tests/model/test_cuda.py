"""The model and paged attention on CUDA, fp32 and bf16, against the same oracles as the CPU tests
(transformers fp32 on CPU; a float64 dense attention), with decode attention in SDPA and in the Triton
kernel (engine/executor/attention/triton_decode.py). Skipped without a GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_harness import MODES, Mode, prompt_logits, run_greedy, save_byte_tokenizer
from test_model_correctness import (
    NEW_TOKENS,
    PROMPT_LENGTHS,
    TINY_CONFIGS,
    _hf_greedy_one_by_one,
    _hf_last_logits,
    _tiny_hf_model,
)
from test_paged_attention import MIXED, run_case

from engine.executor.attention import triton_decode
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.kv_cache import KVCache
from engine.executor.models import build_model
from engine.executor.models.registry import NativeModel
from engine.model_config import ModelConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3)])
def test_paged_attention_fp32(heads: int, kv_heads: int) -> None:
    run_case(MIXED, heads, kv_heads, device="cuda", tol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_bf16(window: int | None) -> None:
    run_case(MIXED, 8, 2, dtype=torch.bfloat16, sliding_window=window, device="cuda", tol=6e-2)


@pytest.fixture(scope="module")
def triton_kernel() -> triton_decode.TritonDecodeKernel:
    pytest.importorskip("triton")
    return triton_decode.load()


# (cached context, 1 new token): within one block, on block edges, several splits (3000 tokens), empty
DECODES = [(c, 1) for c in (0, 5, 15, 16, 17, 40, 100, 700, 3000)]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (9, 3, 32), (32, 8, 128), (16, 2, 128)]
)
def test_triton_kernel_fp32(triton_kernel: DecodeKernel, heads: int, kv_heads: int, head_dim: int) -> None:
    run_case(
        DECODES,
        heads,
        kv_heads,
        head_dim=head_dim,
        block_size=16,
        device="cuda",
        kernel=triton_kernel,
        tol=1e-4,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 7, 600])
def test_triton_kernel_half_precision_and_sliding_window(
    triton_kernel: DecodeKernel, dtype: torch.dtype, window: int | None
) -> None:
    run_case(
        DECODES,
        32,
        8,
        head_dim=128,
        block_size=16,
        sliding_window=window,
        dtype=dtype,
        device="cuda",
        kernel=triton_kernel,
        tol=6e-2,
    )


@pytest.mark.parametrize("block_size", [8, 32, 64, 128])
def test_triton_kernel_block_sizes(triton_kernel: DecodeKernel, block_size: int) -> None:
    run_case(DECODES, 8, 2, head_dim=64, block_size=block_size, device="cuda", kernel=triton_kernel, tol=1e-4)


def test_triton_kernel_never_reads_slots_beyond_the_sequence(triton_kernel: DecodeKernel) -> None:
    """Freed blocks may hold anything (even NaN): no score is computed for a slot past a sequence's end."""
    run_case(
        DECODES, 8, 2, head_dim=64, block_size=16, device="cuda", kernel=triton_kernel, stale=float("nan")
    )
    run_case(
        DECODES,
        8,
        2,
        head_dim=64,
        block_size=16,
        device="cuda",
        kernel=triton_kernel,
        stale=float("nan"),
        sliding_window=9,
    )


def test_triton_kernel_in_mixed_batches(triton_kernel: DecodeKernel) -> None:
    """Decodes through the kernel, prefill chunks through SDPA, every new token's K/V through its writes."""
    run_case(MIXED, 8, 2, head_dim=64, block_size=16, device="cuda", kernel=triton_kernel, tol=1e-4)
    run_case(
        MIXED,
        8,
        2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        kernel=triton_kernel,
        tol=6e-2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rotary_and_gate_match_pytorch(dtype: torch.dtype) -> None:
    """The one-kernel rotation and SwiGLU gate that native models take on CUDA give PyTorch's forms'
    results (the same roundings; the gate's exp within an ulp)."""
    pytest.importorskip("triton")
    from engine.executor.kernels import triton_elementwise
    from engine.executor.models.layers import RotaryEmbedding, SiluAndMul

    gen = torch.Generator(device="cuda").manual_seed(0)
    rotary = RotaryEmbedding(128, 4096, 500000.0, None, dtype, torch.device("cuda"))
    qkv = torch.randn(70, 48 * 128, device="cuda", generator=gen).to(dtype)
    qk = qkv[:, : 40 * 128].view(70, 40, 128)  # Llama-3-8B's 32 + 8 heads of a fused qkv row
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (70,), device="cuda", generator=gen))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(triton_elementwise.rotate(qk, cos, sin), rotary.rotate(qk, cos, sin), **tol)
    gate_up = torch.randn(70, 2 * 14336, device="cuda", generator=gen).to(dtype)
    torch.testing.assert_close(triton_elementwise.silu_and_mul(gate_up), SiluAndMul()(gate_up), **tol)


def test_kv_cache_sized_from_free_gpu_memory() -> None:
    free, _ = torch.cuda.mem_get_info()
    cache = KVCache.allocate(2, 16, 2, 64, torch.bfloat16, "cuda", memory_fraction=0.01)
    assert cache.kv.is_cuda
    assert cache.nbytes <= 0.01 * free
    before = cache.kv[:, :, 0].clone()
    cache.copy_blocks([(0, 1)])
    assert torch.equal(cache.kv[:, :, 1], before)


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request: pytest.FixtureRequest) -> dict[str, Any]:
    hf_model = _tiny_hf_model(request.param)
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS
    ]
    return {
        "hf": hf_model,
        "config": ModelConfig.from_hf_dict(hf_model.config.to_dict()),
        "prompts": prompts,
        "ref_logits": _hf_last_logits(hf_model, prompts),
        "ref_tokens": _hf_greedy_one_by_one(hf_model, prompts),
    }


def _on_cuda(tiny: dict[str, Any], dtype: torch.dtype) -> tuple[NativeModel, KVCache]:
    config: ModelConfig = tiny["config"]
    model = build_model(config, dtype, "cuda")
    model.load_weights(tiny["hf"].state_dict().items())
    blocks = sum(-(-(len(p) + NEW_TOKENS) // 4) for p in tiny["prompts"]) + 3
    cache = KVCache(
        config.num_hidden_layers, blocks, 4, config.num_key_value_heads, config.head_dim, dtype, "cuda"
    )
    return model, cache


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_tiny_models_fp32(tiny: dict[str, Any], mode: Mode, backend: str) -> None:
    model, cache = _on_cuda(tiny, torch.float32)
    kernel = None
    if backend == "triton":
        pytest.importorskip("triton")
        kernel = triton_decode.load()
        cfg = model.config
        if kernel.unsupported(
            cfg.head_dim, 4, cfg.num_queries_per_kv, torch.float32, cfg.attn_logit_softcapping
        ):
            pytest.skip("the Triton kernel does not run this shape (or Gemma 2's soft cap)")
    logits = prompt_logits(model, cache, tiny["prompts"], mode, decode_kernel=kernel).cpu()
    assert (logits - tiny["ref_logits"]).abs().max().item() <= 1e-3
    assert (
        run_greedy(model, cache, tiny["prompts"], NEW_TOKENS, mode, decode_kernel=kernel)
        == tiny["ref_tokens"]
    )


@pytest.mark.parametrize("mode", MODES)
def test_tiny_models_bf16(tiny: dict[str, Any], mode: Mode) -> None:
    """bf16 rounds every activation: logits stay close to the fp32 oracle; greedy paths may drift apart
    after a near-tie, so only the first generated token (the argmax of those logits) is compared, where
    the oracle's margin is clear."""
    model, cache = _on_cuda(tiny, torch.bfloat16)
    logits = prompt_logits(model, cache, tiny["prompts"], mode).cpu()
    ref = tiny["ref_logits"]
    scale = ref.abs().max().item()
    assert (logits - ref).abs().max().item() <= 0.05 * scale + 0.02
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
    assert torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("scale_in_float32", [False, True], ids=["weight-in-dtype", "float32-weight"])
def test_the_triton_norm_rounds_where_rmsnorm_does(scale_in_float32: bool) -> None:
    """bfloat16 rows: the Triton norm and ``RMSNorm``'s PyTorch path are each within their roundings of a
    float64 reference: two with a bfloat16 weight (Llama's order: rounded, then scaled), one with a float32
    weight (Gemma's: scaled in float32, rounded once); plus the float32 sum of squares and a few ulp."""
    pytest.importorskip("triton")
    from engine.executor.kernels.triton_rms_norm import rms_norm
    from engine.executor.models.layers import RMSNorm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(64, 512, device="cuda", generator=gen) * 3).bfloat16()
    norm = RMSNorm(512, 1e-5, torch.bfloat16, torch.device("cuda"), scale_in_float32)
    norm.weight.data.copy_(torch.rand(512, device="cuda", generator=gen) + 0.5)
    x64, w64 = x.double(), norm.weight.double()
    exact = w64 * x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-5)
    rtol = 600 * 2.0**-24 + (1 if scale_in_float32 else 2) * 2.0**-8
    for ours in (rms_norm(x, norm.weight, 1e-5), norm(x)):
        assert ours.dtype == torch.bfloat16
        assert bool(((ours.double() - exact).abs() <= rtol * exact.abs()).all())


# ---------------------------------------------------------------------- CUDA graphs of the decode step
def _byte_tokenizer_folder(folder: Path, vocab_size: int) -> Path:
    """A byte-level tokenizer (256 byte tokens + <eos>) and a tiny Llama config: any machine can build it."""
    save_byte_tokenizer(folder)
    config = ModelConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        eos_token_ids=(256,),
    )
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return folder


def _finals(manager: Any, ids: list[str]) -> dict[str, Any]:
    """Each request's finished output, from a started manager (two minutes at most between outputs)."""
    finals: dict[str, Any] = {}
    while len(finals) < len(ids):
        out = manager.get_result(timeout=120)
        assert out is not None, "the engine stalled"
        if out.is_finished:
            finals[out.request_id] = out
    return finals


def test_cuda_graph_decode_steps_match_eager_steps(tmp_path: Path) -> None:
    """Every decode step the engine replays from a graph (batch sizes padded to 1, 2, 4, 8) gives the logits
    the eager forward gives for the same step; and greedy generations agree with an engine without graphs."""
    pytest.importorskip("triton")
    from engine.engine import Engine

    folder = _byte_tokenizer_folder(tmp_path / "tiny", vocab_size=257)
    engine = Engine.from_pretrained(
        str(folder),
        load_format="dummy",
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory=64 << 20,
    )
    assert engine.attention_backend == "triton" and engine.cuda_graphs is not None
    assert engine.cuda_graphs.sizes == [1, 2, 4, 8]
    prompts = [
        engine.tokenizer.encode(t) for t in ("a", "hello there", "1, 2, 3, 4, 5, 6", "x" * 40, "yes, no")
    ]
    manager = engine.init_continuous_batching()
    runner = manager.executor
    replayed: list[int] = []
    graph_run = runner.cuda_graphs.run  # type: ignore[union-attr]

    def checked(batch: Any) -> torch.Tensor:
        graph = graph_run(batch).clone()
        eager = runner.model(runner.prepare(batch), runner.kv_cache, runner.decode_kernel)  # in batch order
        torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4)
        replayed.append(len(batch.requests))
        return graph

    runner.cuda_graphs.run = checked  # type: ignore[union-attr,method-assign]
    manager.start()
    try:
        ids = [
            manager.add_request(p, max_new_tokens=6 + 5 * i, do_sample=False, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        graphs = _finals(manager, ids)
    finally:
        manager.stop()
    assert set(replayed) >= {5, 3, 1}, replayed  # padded to 8, 4 and 1
    eager_engine = Engine.from_pretrained(
        str(folder),
        load_format="dummy",
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        enforce_eager=True,
        kv_cache_memory=64 << 20,
    )
    assert eager_engine.cuda_graphs is None
    eager = eager_engine.generate_batch(
        prompts, progress_bar=False, do_sample=False, ignore_eos=True, max_new_tokens=26
    )
    for i, rid in enumerate(ids):
        out = graphs[rid]
        assert out is not None and len(out.generated_ids) == 6 + 5 * i
        assert out.generated_ids == eager[f"batch_req_{i}"].generated_ids[: 6 + 5 * i]


# ---------------------------------------------------------------------- speculative verify rows on CUDA
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_verify_rows_give_plain_greedy_tokens(tmp_path: Path, dtype: str) -> None:
    """Prompt lookup and early exit on CUDA: each step's verify rows (the last token plus the drafts, a short
    chunk over the sequence's pages) accept only what greedy decoding picks, so 6 concurrent requests get
    plain decoding's tokens (prompt lookup's drafts proposed and some accepted)."""
    pytest.importorskip("triton")
    from engine.engine import Engine

    folder = _byte_tokenizer_folder(tmp_path / "tiny", vocab_size=257)
    engine = Engine.from_pretrained(
        str(folder), load_format="dummy", device="cuda", dtype=dtype, max_num_seqs=8, kv_cache_memory=64 << 20
    )
    texts = ["abcabcabcabcabc", "the cat the cat the cat", "1 2 3 1 2 3 1 2", "x" * 30, "hi hi hi", "no"]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    kwargs = dict(progress_bar=False, do_sample=False, ignore_eos=True, max_new_tokens=24)
    plain = engine.generate_batch(prompts, **kwargs)
    for config in (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 64},
        {"method": "early_exit", "num_layers": 2, "num_speculative_tokens": 3},
    ):
        manager = engine.init_continuous_batching(speculative_config=config)
        manager.start()
        try:
            ids = [
                manager.add_request(p, max_new_tokens=24, do_sample=False, ignore_eos=True) for p in prompts
            ]
            finals = _finals(manager, ids)
        finally:
            manager.stop()
        stats = manager.stats()
        manager.check_integrity()
        for i, rid in enumerate(ids):
            assert finals[rid].generated_ids == plain[f"batch_req_{i}"].generated_ids, (config, i)
        if (
            config["method"] == "ngram"
        ):  # random weights: early exit's drafts may all fall under its threshold
            assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0


# ---------------------------------------------------------------------- batch invariance on CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_kernels_give_a_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """The matmul, the norm and the decode kernel of ``--batch-invariant``: a row alone and the same row
    among 1 to 300 others (and among longer sequences, for attention) are the same bits; each is close to a
    float64 reference."""
    pytest.importorskip("triton")
    from engine.executor.kernels import cuda_batch_invariant as bi
    from engine.executor.kernels.triton_rms_norm import rms_norm
    from engine.executor.models.layers import RMSNorm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 512, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(384, 512, device="cuda", generator=gen) * 0.05).to(dtype)
    norm_w = torch.randn(512, device="cuda", generator=gen).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    full = bi.matmul(x, w)
    ref = x.double() @ w.double().T
    assert (full.double() - ref).abs().max().item() <= tol * ref.abs().max().item()
    normed = rms_norm(x, norm_w, 1e-5)
    pytorch = RMSNorm(512, 1e-5, dtype, torch.device("cuda"))
    pytorch.weight.data.copy_(norm_w)
    torch.testing.assert_close(normed, pytorch(x), atol=tol, rtol=tol)
    for rows in (1, 7, 64, 65, 299):
        assert torch.equal(bi.matmul(x[:rows], w), full[:rows]), rows
        assert torch.equal(rms_norm(x[:rows], norm_w, 1e-5), normed[:rows]), rows

    kernel = triton_decode.load(batch_invariant=True)
    block, kv_heads, heads, head_dim = 16, 2, 8, 64
    lens = [37, 3000, 700, 1, 1200]
    pages = [-(-n // block) for n in lens]
    k_cache = torch.randn(sum(pages) + 1, kv_heads, head_dim, block, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(sum(pages) + 1, kv_heads, block, head_dim, device="cuda", generator=gen).to(dtype)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int64, device="cuda")
    first = 1
    for i, p in enumerate(pages):
        tables[i, :p] = torch.arange(first, first + p)
        first += p
    q = torch.randn(len(lens), heads, head_dim, device="cuda", generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, device="cuda")
    batched = kernel(q, k_cache, v_cache, tables, seq_lens, 0.125)
    for i, p in enumerate(pages):
        alone = kernel(q[i : i + 1], k_cache, v_cache, tables[i : i + 1, :p], seq_lens[i : i + 1], 0.125)
        assert torch.equal(alone[0], batched[i]), i
    # a prompt's last rows through prefill: the same bits as decode queries at those positions
    prefill = kernel.prefill(
        q[:1].expand(3, -1, -1).contiguous(), k_cache, v_cache, tables[1:2], torch.tensor([0, 3]),
        seq_lens[1:2], 0.125, None,
    )  # fmt: skip
    as_decode = kernel(q[:1].expand(3, -1, -1).contiguous(), k_cache, v_cache, tables[[1, 1, 1]],
                       seq_lens[1] - torch.tensor([2, 1, 0], device="cuda"), 0.125)  # fmt: skip
    assert torch.equal(prefill, as_decode)


def _logprobs_of(engine: Any, batch: list[tuple[list[int], int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Every (prompt, new tokens) of ``batch`` added at once, greedy; each one's tokens and logprobs."""
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        ids = [
            manager.add_request(p, max_new_tokens=n, do_sample=False, ignore_eos=True, output_logprobs=True)
            for p, n in batch
        ]
        finals = _finals(manager, ids)
    finally:
        manager.stop()
    return [
        (
            finals[i].generated_ids,
            torch.tensor([lp.logprob for lp in finals[i].logprobs], dtype=torch.float64),
        )
        for i in ids
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_engine_on_cuda(tmp_path: Path, dtype: str) -> None:
    """``batch_invariant=True`` on CUDA (CUDA graphs on): two prompts' greedy tokens and logprobs alone are
    the same bits as beside long prompts whose prefill is chunked into the same steps, and inside a
    decode batch of 12."""
    pytest.importorskip("triton")
    from engine.engine import Engine

    folder = _byte_tokenizer_folder(tmp_path / "tiny", vocab_size=257)
    engine = Engine.from_pretrained(
        str(folder), load_format="dummy", device="cuda", dtype=dtype, batch_invariant=True,
        max_num_seqs=16, max_batch_tokens=96, kv_cache_memory=64 << 20,
    )  # fmt: skip
    assert engine.batch_invariant and engine.cuda_graphs is not None
    gen = torch.Generator().manual_seed(3)
    checked = [(torch.randint(0, 256, (n,), generator=gen).tolist(), 16) for n in (5, 70)]
    long = [(torch.randint(0, 256, (300,), generator=gen).tolist(), 4) for _ in range(3)]
    short = [(torch.randint(0, 256, (9,), generator=gen).tolist(), 24) for _ in range(10)]
    alone = [_logprobs_of(engine, [c])[0] for c in checked]
    for before in (long, short):
        got = _logprobs_of(engine, [*before, *checked])[len(before) :]
        for (ids, lp), (alone_ids, alone_lp) in zip(got, alone, strict=True):
            assert ids == alone_ids
            assert torch.equal(lp, alone_lp), (lp - alone_lp).abs().max().item()
