"""bench/kernel_ab.py end to end: the kernels of a commit against this checkout's, here the checkout's own
commit, so both sides must give the same bits on every case."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from bench.kernel_ab import ATTENTION, KERNELS, checkout_kernels, main
from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import amx_gemm, bf16_gemm, cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def _head() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    return done.stdout.strip()


def test_checks_out_the_kernel_sources_of_a_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    folder = checkout_kernels(_head(), tmp_path)
    assert folder == tmp_path / KERNELS
    assert {"cpu_ops.c", "amx_gemm.c", "exp16.h"} <= {p.name for p in folder.iterdir()}
    assert {"cpu_attention.c", "paged_decode.c"} <= {p.name for p in (tmp_path / ATTENTION).iterdir()}


@pytest.mark.slow  # builds the kernels of both sides
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_commit_against_itself_gives_the_same_bits(
    dtype: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not cpu_ops.CpuOps.supports(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"no fused ops in {dtype}")
    try:
        cpu_ops.load()
    except KernelUnavailable as e:
        pytest.skip(f"the fused ops cannot be built here: {e}")
    monkeypatch.chdir(ROOT)
    argv = ["--before", _head(), "--rows", "3", "40", "70", "--rounds", "1", "--layers", "1", "--dtype", dtype,
            "--prompt-len", "32"]  # fmt: skip
    assert main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "ms median" in ln]
    # three ops at each row count, decode attention at 3 and 40, prefill attention of 32 + 32 + 6 tokens at 70,
    # and the matmuls where the CPU has AMX
    assert len(lines) >= 12 and sum("decode attention" in ln for ln in lines) == 2
    assert sum("prefill attention" in ln for ln in lines) == 1
    assert all(ln.endswith("same bits") for ln in lines), lines
    if dtype == "bfloat16" and (amx_gemm.load.available() or bf16_gemm.load.available()):
        # the layers' matmuls at each row count; over Q4_1 blocks and the Q8_0 head at 3 rows (AMX: also 40)
        assert sum("layers' matmuls" in ln for ln in lines) == 3 and sum("Q4_1" in ln for ln in lines) >= 1
