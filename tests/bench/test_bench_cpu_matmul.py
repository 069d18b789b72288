"""bench/cpu_matmul.py end to end on small shapes: every system is checked against F.linear and timed."""

from __future__ import annotations

import pytest
import torch

from bench.cpu_matmul import layer_shapes, main
from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import prepacked, small_gemm


def test_layer_shapes_are_the_fused_projections() -> None:
    assert layer_shapes(576, 1536, 9, 3) == [(576, 960), (576, 576), (576, 3072), (1536, 576)]


@pytest.mark.slow  # every system timed
def test_prints_one_line_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    if not prepacked.can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN prepacking in this torch build")
    try:
        small_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the small-batch kernel cannot be built here: {e}")
    argv = [
        "--rows",
        "3",
        "40",
        "--hidden",
        "64",
        "--intermediate",
        "96",
        "--q-heads",
        "4",
        "--kv-heads",
        "2",
    ]
    assert main([*argv, "--rounds", "1", "--work", "1e6"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]
    assert [line.split(":")[0].split()[-1] for line in lines] == ["3", "40"]
    # as a decode step: two layers' weights of their own, read one after the other; the bytes per second too
    assert main([*argv, "--rounds", "1", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("rows")]
    assert "2 layers of weights of their own" in out and len(lines) == 2
    assert all(line.count("GB/s") == 3 for line in lines)
    assert all(line.count("GFLOPS") == 3 for line in lines)
