"""The CUDA Triton kernels' arithmetic on any machine: Triton's interpreter (``TRITON_INTERPRET=1``) runs
them on CPU tensors in float32, against float64 references. The decode kernel in both forms (its default
splits, and the batch-invariant one with its prefill), windows, pages smaller than a tile; the
batch-invariant matmul and the RMSNorm kernel. tests/model/test_cuda.py runs them on a GPU, bits and speed
included; skipped here where a GPU is present (the kernels compiled for it are cached per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from engine.executor.attention import triton_decode  # noqa: E402
from engine.executor.kernels import cuda_batch_invariant, triton_elementwise, triton_rms_norm  # noqa: E402
from engine.executor.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402

# NOTE: Triton reads TRITON_INTERPRET when it is imported (its own library functions are jitted then), so
# the checks below run in a child pytest started with it; in this process they skip.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernels")
inside = pytest.mark.skipif(not INTERPRETED, reason="runs in the child started with TRITON_INTERPRET=1")

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 4, 32
TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 kernels against float64


@pytest.mark.slow  # a child interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_the_kernels_under_tritons_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(Path(__file__)),
        "-k",
        "not under",
    ]
    done = subprocess.run(
        argv, env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "8 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


@inside
def test_matmul_and_norm_match_float64_and_a_row_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, g = (
        torch.randn(70, 96, generator=gen),
        torch.randn(130, 96, generator=gen),
        torch.randn(96, generator=gen),
    )
    out = cuda_batch_invariant.matmul(x, w)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)
    assert torch.equal(cuda_batch_invariant.matmul(x[:1], w)[0], out[0])
    norm = RMSNorm(96, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data.copy_(g)
    torch.testing.assert_close(triton_rms_norm.rms_norm(x, g, 1e-5), norm(x), atol=1e-5, rtol=1e-5)


@inside
def test_rotary_and_gate_match_pytorchs_forms() -> None:
    """The rotation (q and k of a fused qkv row, a strided view, as attention passes it) and SwiGLU's gate
    against the PyTorch modules they replace, in float64 as the reference."""
    gen = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None, torch.float64, torch.device("cpu"))
    qkv = torch.randn(9, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(9, HEADS + KV_HEADS, HEAD_DIM)
    cos, sin = rotary.cos_sin(torch.tensor([0, 1, 2, 3, 40, 41, 42, 63, 5]))
    out = triton_elementwise.rotate(qk, cos.float(), sin.float())
    torch.testing.assert_close(out.double(), rotary.rotate(qk.double(), cos, sin), **TOL)
    gate_up = torch.randn(5, 2 * 1500, generator=gen)  # two programs a row, the second partly masked
    torch.testing.assert_close(
        triton_elementwise.silu_and_mul(gate_up).double(), SiluAndMul()(gate_up.double()), **TOL
    )


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int,
               window: int | None) -> torch.Tensor:  # fmt: skip
    """One query ``[heads, head_dim]`` over the first ``length`` tokens of ``table``'s pages, in float64."""
    tokens = torch.arange(max(0, length - window) if window else 0, length)
    blocks, rows = table[tokens // BLOCK], tokens % BLOCK
    group = HEADS // KV_HEADS
    keys = k_cache[blocks, :, :, rows].repeat_interleave(group, dim=1).double()  # [L, heads, head_dim]
    values = v_cache[blocks, :, rows, :].repeat_interleave(group, dim=1).double()
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) * 0.3
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


@inside
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("window", [None, 6, 13])
def test_decode_kernel_matches_float64(batch_invariant: bool, window: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(40, KV_HEADS, HEAD_DIM, BLOCK, generator=gen)
    v_cache = torch.randn(40, KV_HEADS, BLOCK, HEAD_DIM, generator=gen)
    lens = [5, 23, 9]
    tables = torch.zeros(len(lens), 8, dtype=torch.int64)
    pages = (torch.randperm(39, generator=gen) + 1).tolist()
    for i, n in enumerate(lens):
        for p in range(-(-n // BLOCK)):
            tables[i, p] = pages.pop()
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen)
    kernel = triton_decode.load(batch_invariant)
    kernel.tokens_per_split = 8  # several splits even for these short sequences
    out = kernel(q, k_cache, v_cache, tables, torch.tensor(lens), 0.3, window)
    for i, n in enumerate(lens):
        torch.testing.assert_close(
            out[i].double(), _reference(q[i], k_cache, v_cache, tables[i], n, window), **TOL
        )
    if batch_invariant:
        alone = kernel(q[:1], k_cache, v_cache, tables[:1, :2], torch.tensor(lens[:1]), 0.3, window)
        assert torch.equal(alone[0], out[0])
        # prefill: the last 6 of sequence 1's 23 tokens, and all 9 of sequence 2's
        queries = torch.randn(15, HEADS, HEAD_DIM, generator=gen)
        got = kernel.prefill(
            queries,
            k_cache,
            v_cache,
            tables[1:],
            torch.tensor([0, 6, 15]),
            torch.tensor([23, 9]),
            0.3,
            window,
        )
        positions = [(1, 18 + r) for r in range(6)] + [(2, 1 + r) for r in range(9)]
        for row, (seq, length) in enumerate(positions):
            want = _reference(queries[row], k_cache, v_cache, tables[seq], length, window)
            torch.testing.assert_close(got[row].double(), want, **TOL)
