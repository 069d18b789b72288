"""The decode stack (engine/executor/decode_stack.py): every decoder layer of a CPU decode step in one C call
(float32; bfloat16 where the CPU has AMX-BF16 or AVX512-BF16: on AMX tiles, or on the dot-product kernel's
panels, also on an AMX CPU with its tiles hidden) gives the bits of the layer-by-layer path (the same kernels
in the same order), writes the same K/V,
keeps the caller's logits order, refuses bad slots and positions before writing anything, and runs
exactly the steps it can: pure decode batches with the CPU decode kernel and the CPU fast paths in.
Gemma 2's layers (four norms, GELU-tanh, soft caps, per-layer windows), Gemma 3's and Qwen3's per-head q/k
norms and Gemma 3's second rotary table included.
Its agreement with transformers is checked by tests/model/test_model_correctness.py (the "cpu" path)."""

from __future__ import annotations

import ctypes
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from default_engine import engine_on
from model_harness import cpu_kernel_or_skip

from engine.cpu import native_build
from engine.engine import Engine
from engine.executor import fast_paths
from engine.executor.attention.cpu_kernel import PagedDecodeKernel
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.fast_paths import apply_cpu_fast_paths
from engine.executor.inputs import BatchInputs
from engine.executor.kernels import amx_gemm, bf16_gemm
from engine.executor.kv_cache import KVCache
from engine.executor.models import LlamaForCausalLM, build_model
from engine.executor.models.registry import NativeModel
from engine.loader.dummy import get_preset
from engine.loader.model_loader import LoadedModel
from engine.model_config import ModelConfig

CPU = torch.device("cpu")
BLOCK = 16
NUM_BLOCKS = 48


def _model(cfg: ModelConfig, seed: int = 0, kind: str = "float32") -> CpuDecodeStack:
    """``cfg`` with random weights, set up as the engine sets up a CPU model: its decode stack. ``kind``:
    float32; bfloat16 (AMX tiles, else the AVX512-BF16 kernel); bfloat16-dot (the AVX512-BF16 kernel on a
    CPU with AMX, its tiles hidden)."""
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    hide_amx = kind == "bfloat16-dot"
    if dtype == torch.bfloat16:
        _bf16_kernel_or_skip(hide_amx)
    model = build_model(cfg, dtype, CPU)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "norm" in name else 0.05
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    with pytest.MonkeyPatch.context() as patch:
        if hide_amx:
            patch.setattr(fast_paths, "_amx", lambda model: None)
        paths = apply_cpu_fast_paths(model)
    if paths.small_gemm is None and dtype == torch.float32:
        pytest.skip("this torch build cannot prepack weights (no oneDNN) or the small kernel cannot be built")
    if paths.fused_ops is None:
        pytest.skip("the fused CPU ops cannot be built here")
    stack = CpuDecodeStack.for_model(model)
    if stack is None:
        pytest.skip("the decode stack cannot be built here")
    return stack


def _bf16_kernel_or_skip(hide_amx: bool) -> None:
    """Skip where the bfloat16 stack has no kernel; with ``hide_amx``, also where the CPU has no AMX (its
    plain bfloat16 case runs the AVX512-BF16 kernel already)."""
    amx, dot = amx_gemm.load.available(), bf16_gemm.load.available()
    if hide_amx and not (amx and dot):
        pytest.skip("the AVX512-BF16 kernel with AMX hidden: needs a CPU with both")
    if not (amx or dot):
        pytest.skip("the bfloat16 stack runs on AMX tiles or AVX512-BF16 dot products: neither here")


KINDS = ["float32", "bfloat16", "bfloat16-dot"]


# SmolLM2-135M's layer shapes (9 query heads over 3 KV heads of 64: the kernel's unrolled attention), 2 layers
SMOL = dataclasses.replace(get_preset("smollm2-135m"), vocab_size=500, num_hidden_layers=2)
# biases on q/k/v (Qwen2), a sliding window (Mistral), head_dim 32 with groups of 4 (the generic loops)
ODD = dataclasses.replace(SMOL, architecture="qwen2", attention_bias=True, sliding_window=40, hidden_size=256,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=320)  # fmt: skip


# Gemma 2: four norms a layer, GELU-tanh, soft-capped scores (a cap of 0.5 bends them), a window of 24 on
# the first layer only
GEMMA2 = dataclasses.replace(SMOL, architecture="gemma2", sliding_window=24, full_attention_layers=(1,),
                             attn_logit_softcapping=0.5, final_logit_softcapping=3.0, attention_multiplier=0.1)  # fmt: skip


# Gemma 3: q/k norms per head, the local layer rotated by its own table (base 1e4), the global one by a
# linearly scaled one; Qwen3: q/k norms
GEMMA3 = dataclasses.replace(SMOL, architecture="gemma3_text", qk_norm=True, sliding_window=24,
                             full_attention_layers=(1,), local_rope_theta=1e4, rope_theta=1e6,
                             rope_scaling={"rope_type": "linear", "factor": 4.0}, attention_multiplier=0.1)  # fmt: skip
QWEN3 = dataclasses.replace(SMOL, architecture="qwen3", qk_norm=True)


@pytest.fixture(scope="module", autouse=True)
def _two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the threads share each phase's work: the split must not change a bit
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    return cpu_kernel_or_skip()


def _cache(cfg: ModelConfig, dtype: torch.dtype) -> KVCache:
    return KVCache(
        cfg.num_hidden_layers, NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype, CPU
    )


def _prefilled(
    model: NativeModel,
    kernel: PagedDecodeKernel,
    lengths: list[int],
    seed: int,
    new_tokens: list[int] | None = None,
) -> dict[str, Any]:
    """Two identical caches holding prompts of ``lengths`` (pages scattered over the cache), and the decode
    step that follows: one token per sequence, or ``new_tokens[i]`` for sequence i -- a verify chunk, one
    decode row per token over the same pages, as engine/executor/runner.py's ``prepare`` lays it out."""
    new_tokens = new_tokens or [1] * len(lengths)
    rng = random.Random(seed)
    blocks = list(range(1, NUM_BLOCKS))
    rng.shuffle(blocks)
    tables = []
    for n, new in zip(lengths, new_tokens, strict=True):
        pages = -(-(n + new) // BLOCK)
        tables.append(blocks[:pages])
        blocks = blocks[pages:]
    cfg = model.config
    vocab = cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    caches = [_cache(cfg, model.dtype), _cache(cfg, model.dtype)]
    prefill = BatchInputs.build(prompts, [0] * len(lengths), tables, [True] * len(lengths), BLOCK)
    for cache in caches:
        model(prefill, cache, kernel)
    rows = [
        (n + j, table) for n, new, table in zip(lengths, new_tokens, tables, strict=True) for j in range(new)
    ]
    decode = BatchInputs.build(
        [[rng.randrange(vocab)] for _ in rows],
        [p for p, _ in rows],
        [t for _, t in rows],
        [1] * len(rows),
        BLOCK,
    )
    return {"caches": caches, "decode": decode}


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every decode-stack call from now on."""
    calls: list[int] = []
    real = CpuDecodeStack.__call__

    def counted(self: CpuDecodeStack, x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(self, x, *args)

    monkeypatch.setattr(CpuDecodeStack, "__call__", counted)
    return calls


@pytest.mark.parametrize(
    "cfg",
    [SMOL, ODD, GEMMA2, GEMMA3, QWEN3],
    ids=[
        "smollm2-shapes",
        "bias-window-head32",
        "gemma2-softcap-windows",
        "gemma3-qk-norms-local-rope",
        "qwen3",
    ],
)
@pytest.mark.parametrize(
    "lengths", [[7], [150], [1, 15, 16, 17, 40, 33, 90, 2]], ids=["one", "one-of-ten-pages", "eight"]
)
@pytest.mark.parametrize("kind", KINDS)
def test_the_same_bits_as_layer_by_layer(
    kernel: PagedDecodeKernel,
    monkeypatch: pytest.MonkeyPatch,
    cfg: ModelConfig,
    lengths: list[int],
    kind: str,
) -> None:
    """Logits and both caches' K/V are equal bit for bit; the sequences come in unsorted, so the batch is
    reordered by length and the logits must come back in the caller's order. A lone row's attention runs
    split over the threads (its pages' scores, its heads' softmax, its output lanes) in the stack, whole in
    the layer-by-layer kernel."""
    stack = _model(cfg, kind=kind)
    state = _prefilled(stack.model, kernel, lengths, seed=len(lengths))
    stacked_cache, layered_cache = state["caches"]
    calls = _count_calls(monkeypatch)
    stacked = stack.forward(state["decode"], stacked_cache, kernel)
    assert calls == [len(lengths)]
    layered = stack.model(state["decode"], layered_cache, kernel)
    assert torch.equal(stacked, layered)
    assert torch.equal(stacked_cache.kv, layered_cache.kv)
    assert stacked.shape == (len(lengths), cfg.vocab_size)


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_past_one_tile_of_rows_is_the_same_bits(kernel: PagedDecodeKernel, kind: str) -> None:
    """20 sequences: in bfloat16 past one AMX tile of 16 rows (the matmuls run blocks of 32, zero-padded),
    past one block of 12 rows of the AVX512-BF16 kernel."""
    stack = _model(SMOL, kind=kind)
    state = _prefilled(stack.model, kernel, [3 + (7 * i) % 12 for i in range(20)], seed=20)
    stacked_cache, layered_cache = state["caches"]
    assert stack.can_run(state["decode"], kernel)
    stacked = stack.run(state["decode"], stacked_cache)
    layered = stack.model(state["decode"], layered_cache, kernel)
    assert torch.equal(stacked, layered)
    assert torch.equal(stacked_cache.kv, layered_cache.kv)


class _RowByRow(PagedDecodeKernel):
    """The CPU decode kernel called one row at a time: each row attended alone, as before verify runs."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        alone = super().__call__
        outs = []
        for i in range(q.shape[0]):
            tables, lens = block_tables[i : i + 1], seq_lens[i : i + 1]
            outs.append(alone(q[i : i + 1], k_cache, v_cache, tables, lens, scale, sliding_window, softcap))
        return torch.cat(outs)


@pytest.mark.parametrize("cfg", [SMOL, GEMMA2, ODD], ids=["smollm2-shapes", "gemma2-softcap-windows", "odd"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_verify_chunk_is_the_same_bits_as_its_rows_attended_alone(
    kernel: PagedDecodeKernel, monkeypatch: pytest.MonkeyPatch, cfg: ModelConfig, kind: str
) -> None:
    """Verify chunks of 5 and 3 tokens beside ordinary decode rows: the stack attends each chunk's rows as
    one verify run (paged_decode.c), and its logits and K/V are the layer-by-layer path's with every row
    attended alone."""
    stack = _model(cfg, kind=kind)
    state = _prefilled(stack.model, kernel, [30, 17, 9, 44], seed=7, new_tokens=[5, 1, 3, 1])
    stacked_cache, layered_cache = state["caches"]
    decode: BatchInputs = state["decode"]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    tiles = kernel.decode_tiles(
        decode.block_tables, decode.seq_lens, BLOCK, group, cfg.num_key_value_heads, 2
    )
    if group <= 3:  # the chunks' rows share tiles, with AVX-512's registers and AVX2's (RUN_ROWS)
        assert max(len(tile) for tile in tiles) > 1
    calls = _count_calls(monkeypatch)
    stacked = stack.forward(decode, stacked_cache, kernel)
    assert calls == [10]
    layered = stack.model(decode, layered_cache, _RowByRow(kernel.path))
    assert torch.equal(stacked, layered)
    assert torch.equal(stacked_cache.kv, layered_cache.kv)


def test_an_early_exit_through_the_first_layers_is_the_same_as_layer_by_layer(
    kernel: PagedDecodeKernel,
) -> None:
    """Self-speculative drafting: the first layers, the final norm and the head, and those layers' K/V only."""
    stack = _model(SMOL)
    state = _prefilled(stack.model, kernel, [5, 30, 17], seed=3)
    stacked_cache, layered_cache = state["caches"]
    before = stacked_cache.kv.clone()
    stacked = stack.run(state["decode"], stacked_cache, num_layers=1)
    layered = stack.model(state["decode"], layered_cache, kernel, num_layers=1)
    assert torch.equal(stacked, layered)
    assert torch.equal(stacked_cache.kv, layered_cache.kv)
    full = stack.model(
        state["decode"], _prefilled(stack.model, kernel, [5, 30, 17], seed=3)["caches"][0], kernel
    )
    assert not torch.equal(stacked, full)  # the early exit is not the whole model
    changed = [not torch.equal(stacked_cache.kv[i], before[i]) for i in range(SMOL.num_hidden_layers)]
    assert changed == [True, False]  # the first layer's pages only


def test_bad_slots_and_positions_are_refused_before_anything_is_written(kernel: PagedDecodeKernel) -> None:
    stack = _model(SMOL)
    state = _prefilled(stack.model, kernel, [5, 9], seed=1)
    cache = state["caches"][0]
    before = cache.kv.clone()
    good: BatchInputs = state["decode"]
    x = torch.zeros(2, SMOL.hidden_size)
    outside = torch.tensor([NUM_BLOCKS * BLOCK, 3])
    with pytest.raises(ValueError, match="slot outside"):
        stack(x, dataclasses.replace(good, slot_mapping=outside), cache)
    with pytest.raises(IndexError, match="rotary table"):
        stack(x, dataclasses.replace(good, positions=torch.tensor([5, SMOL.max_position_embeddings])), cache)
    with pytest.raises(ValueError, match="block table"):
        stack(
            x, dataclasses.replace(good, block_tables=torch.full_like(good.block_tables, NUM_BLOCKS)), cache
        )
    assert torch.equal(cache.kv, before)


def test_only_pure_decode_steps_with_the_cpu_kernel_and_fast_paths_take_it(
    kernel: PagedDecodeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = _model(SMOL)
    state = _prefilled(stack.model, kernel, [5, 9], seed=2)
    calls = _count_calls(monkeypatch)
    cache = state["caches"][0]
    stack.forward(state["decode"], cache, None)  # decode attention in SDPA
    mixed = BatchInputs.build([[3], [4, 5, 6]], [5, 9], [[1], [2]], [True, True], BLOCK)
    stack.forward(mixed, cache, kernel)  # a prefill chunk in the batch
    assert calls == []
    stack.forward(state["decode"], cache, kernel)
    assert calls == [2]
    bf16 = build_model(SMOL, torch.bfloat16, CPU)
    apply_cpu_fast_paths(bf16)
    # bfloat16: on AMX tiles or the AVX512-BF16 kernel's panels
    assert (CpuDecodeStack.for_model(bf16) is not None) == (amx_gemm.load.available() or bf16_gemm.load.available())
    assert CpuDecodeStack.for_model(build_model(SMOL, torch.float32, CPU)) is None  # no fast paths swapped in


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model)


def test_the_engine_decodes_through_it_with_the_same_tokens(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model through the Engine API: a float32 CPU engine runs its decode steps in the stack,
    and greedy generation gives the tokens of the layer-by-layer path."""
    assert isinstance(engine.model, LlamaForCausalLM) and engine.decode_stack is not None
    prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3,", "Hello, my name")]
    kwargs: dict[str, Any] = dict(progress_bar=False, max_new_tokens=12, do_sample=False, ignore_eos=True)
    calls = _count_calls(monkeypatch)
    stacked = engine.generate_batch(prompts, **kwargs)
    assert len(calls) >= 11 and max(calls) == 3
    stack, engine.decode_stack = engine.decode_stack, None
    try:
        layered = engine.generate_batch(prompts, **kwargs)
    finally:
        engine.decode_stack = stack
    assert [o.generated_ids for o in stacked.values()] == [o.generated_ids for o in layered.values()]
    assert all(len(o.generated_ids) == 12 for o in stacked.values())


def test_a_change_in_an_included_kernel_rebuilds_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_stack.c includes the other kernels' sources: the build cache is keyed on them too, so an edit
    to small_gemm.c can never load a stale decode stack."""
    try:
        native_build._compiler()
    except native_build.KernelUnavailable as e:
        pytest.skip(str(e))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "inc").mkdir()
    helper = tmp_path / "inc" / "helper.c"
    helper.write_text("static int helper(void) { return 1; }\n")
    main = tmp_path / "main.c"
    main.write_text('#include "inc/helper.c"\nint answer(void) { return helper(); }\n')
    first = native_build.build(main)
    assert native_build.build(main) == first  # cached
    helper.write_text("static int helper(void) { return 2; }\n")
    second = native_build.build(main)
    assert second != first
    assert ctypes.CDLL(str(second)).answer() == 2
