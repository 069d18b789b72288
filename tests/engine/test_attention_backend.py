"""Choosing the decode-attention backend (engine/executor/attention/backend.py) and building the CPU kernel
(engine/executor/attention/cpu_kernel.py): the on-disk cache, a missing compiler, the fallback to SDPA, and the
engine's outputs being the same whichever backend runs them."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import pytest
import torch
from default_engine import engine_on
from model_harness import cpu_kernel_or_skip

from engine.cpu import native_build
from engine.cpu.native_build import BuildOnce
from engine.executor.attention import backend, cpu_kernel, triton_decode
from engine.executor.attention.backend import select_decode_kernel
from engine.executor.attention.cpu_kernel import KernelUnavailable, PagedDecodeKernel
from engine.loader.model_loader import LoadedModel

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only named: nothing here runs on it


def test_auto_picks_the_kernel_on_the_cpu_and_sdpa_when_asked() -> None:
    kernel = cpu_kernel_or_skip()
    assert select_decode_kernel("auto", CPU, torch.float32, 64, 16, 3) is kernel
    assert select_decode_kernel("cpu", CPU, torch.bfloat16, 128, 32, 4) is kernel
    assert select_decode_kernel("sdpa", CPU, torch.float32, 64, 16, 3) is None


def test_unsupported_shapes_fall_back_under_auto_and_fail_under_cpu(caplog: pytest.LogCaptureFixture) -> None:
    cpu_kernel_or_skip()
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert select_decode_kernel("auto", CPU, torch.float32, 64, 8, 3) is None
    assert "block_size 8" in caplog.text and "SDPA" in caplog.text
    with pytest.raises(ValueError, match="'cpu' cannot run here: .*block_size 8"):
        select_decode_kernel("cpu", CPU, torch.float32, 64, 8, 3)
    with pytest.raises(ValueError, match="float16"):
        select_decode_kernel("cpu", CPU, torch.float16, 64, 16, 3)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_decode_kernel("flash", CPU, torch.float32, 64, 16, 3)


def test_each_kernel_runs_on_its_own_device_only() -> None:
    with pytest.raises(ValueError, match="'triton' cannot run here: it runs on cuda and the model is on cpu"):
        select_decode_kernel("triton", CPU, torch.float32, 64, 16, 3)
    with pytest.raises(ValueError, match="'cpu' cannot run here: it runs on cpu and the model is on cuda"):
        select_decode_kernel("cpu", CUDA, torch.bfloat16, 64, 16, 3)
    assert select_decode_kernel("sdpa", CUDA, torch.bfloat16, 64, 16, 3) is None


def test_a_gpu_without_triton_serves_with_sdpa(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unavailable(batch_invariant: bool = False) -> triton_decode.TritonDecodeKernel:
        raise KernelUnavailable("Triton is not installed (No module named 'triton')")

    monkeypatch.setattr(triton_decode, "load", unavailable)
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert select_decode_kernel("auto", CUDA, torch.bfloat16, 128, 16, 4) is None
    assert "triton decode-attention kernel is not used (Triton is not installed" in caplog.text
    with pytest.raises(ValueError, match="'triton' cannot run here: Triton is not installed"):
        select_decode_kernel("triton", CUDA, torch.bfloat16, 128, 16, 4)


def test_the_triton_kernel_says_which_shapes_it_cannot_run() -> None:
    pytest.importorskip("triton")
    kernel = triton_decode.load()
    assert kernel.unsupported(128, 16, 4, torch.bfloat16) is None
    assert kernel.unsupported(64, 32, 1, torch.float32) is None
    assert "head_dim 96" in str(kernel.unsupported(96, 16, 4, torch.bfloat16))
    assert "block_size 24" in str(kernel.unsupported(128, 24, 4, torch.bfloat16))
    assert "float64" in str(kernel.unsupported(128, 16, 4, torch.float64))
    assert "query heads" in str(kernel.unsupported(128, 16, 128, torch.bfloat16))


def test_soft_capped_models_decode_in_the_pytorch_path_on_cuda(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Gemma 2's soft cap of attention scores is not in the Triton kernel: ``auto`` leaves decode to the
    PyTorch path (which computes it, tests/model/test_paged_attention.py) and says why; ``triton`` refuses at
    start. The CPU kernel takes it. Asking needs no GPU: the kernel object is never launched."""
    kernel = object.__new__(triton_decode.TritonDecodeKernel)  # NOTE: no compiled kernels behind it
    monkeypatch.setattr(triton_decode, "load", lambda batch_invariant=False: kernel)
    assert select_decode_kernel("auto", CUDA, torch.bfloat16, 128, 16, 4) is kernel
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert select_decode_kernel("auto", CUDA, torch.bfloat16, 128, 16, 4, softcap=50.0) is None
    assert "attention logit soft-capping (softcap=50.0)" in caplog.text
    with pytest.raises(ValueError, match="'triton' cannot run here: attention logit soft-capping"):
        select_decode_kernel("triton", CUDA, torch.bfloat16, 128, 16, 4, softcap=50.0)
    with pytest.raises(ValueError, match="does not soft-cap"):
        kernel(*[torch.empty(0)] * 5, 0.1, None, 50.0)
    cpu = cpu_kernel_or_skip()
    assert select_decode_kernel("cpu", CPU, torch.float32, 64, 16, 2, softcap=50.0) is cpu


def test_a_machine_without_a_compiler_serves_with_sdpa(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build to fall back on
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelUnavailable, match="no-such-cc"):
        cpu_kernel.build()

    def unavailable() -> PagedDecodeKernel:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH")

    monkeypatch.setattr(cpu_kernel, "load", unavailable)
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert select_decode_kernel("auto", CPU, torch.float32, 64, 16, 3) is None
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="no C compiler"):
        select_decode_kernel("cpu", CPU, torch.float32, 64, 16, 3)


def test_a_compile_error_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu_kernel_or_skip()  # a compiler exists (and the kernel is built, in the usual cache, before the test's)
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    with pytest.raises(KernelUnavailable, match="building broken.c .* failed"):
        cpu_kernel.build()
    assert not list((tmp_path / "cache").rglob("*.so"))  # no half-written object left behind


def test_a_kernel_that_cannot_be_built_is_not_available(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``BuildOnce.available``: False (not raising) where ``load()`` raises, True where it gives the kernel."""
    cpu_kernel_or_skip()
    assert BuildOnce(cpu_kernel.SOURCE, PagedDecodeKernel).available()  # the build cached by the line above
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    load = BuildOnce(broken, PagedDecodeKernel)
    assert not load.available()
    with pytest.raises(KernelUnavailable, match="building broken.c"):
        load()


def test_builds_are_cached_per_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The kernel's build is the on-disk cache's (engine/cpu/native_build.py); a build is found, not redone,
    and a change in a source or in a header it includes builds anew, never loading a stale object (shown on a
    source of a few lines: the cache's rules are the same for every kernel, and the attention kernel's own
    build takes ~20 s)."""
    cpu_kernel_or_skip()
    assert cpu_kernel.build().parent == native_build._cache_dir()  # found in the cache the line above filled
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "answer.h").write_text("#define ANSWER 42\n")
    source = tmp_path / "tiny.c"
    source.write_text('#include "answer.h"\nint tiny(void) { return ANSWER; }\n')
    first = native_build.build(source)
    assert first.is_file() and first.parent == tmp_path / "cache" / "cbserve" / "kernels"
    mtime = first.stat().st_mtime_ns
    assert native_build.build(source) == first and first.stat().st_mtime_ns == mtime  # found, not rebuilt
    (tmp_path / "answer.h").write_text("#define ANSWER 43\n")  # only the included header changes
    second = native_build.build(source)
    assert second != first and os.access(first, os.R_OK)
    assert ctypes.CDLL(str(second)).tiny() == 43 and ctypes.CDLL(str(first)).tiny() == 42
    source.write_text(source.read_text() + "/* changed */\n")
    assert native_build.build(source) not in (first, second)


def test_loading_the_kernel_leaves_the_float_environment_alone() -> None:
    """A library linked with -ffast-math would switch on flush-to-zero / denormals-are-zero for the whole
    process; the kernel is linked without it, so subnormal numbers still exist after it is loaded."""
    cpu_kernel_or_skip()
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 == tiny and tiny + 0.0 > 0.0
    assert torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() > 0.0  # float32 subnormal


# NOTE: the two backends sum attention in different orders (SDPA's is torch's, and differs between CPUs),
# so their logits differ in the last bits; a greedy pick whose top two log-probabilities are closer than
# this may go either way, and the paths may part from there on.
NEAR_TIE = 1e-3


@pytest.mark.slow
def test_engine_outputs_are_the_same_with_either_backend(default_model: LoadedModel) -> None:
    """The public API end to end on the real model: greedy generations agree token for token, up to the
    first near-tie (``NEAR_TIE``) of the cpu backend's pick."""
    cpu_kernel_or_skip()
    prompts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea, there lived",
        "1, 2, 3, 4, 5,",
    ]
    outputs = {}
    for name in ("cpu", "sdpa"):
        engine = engine_on(default_model, attention_backend=name)
        assert engine.attention_backend == name
        ids = [engine.tokenizer.encode(p) for p in prompts]
        results = engine.generate_batch(
            ids, progress_bar=False, max_new_tokens=24, do_sample=False, output_logprobs=True, top_logprobs=2
        )
        outputs[name] = [results[f"batch_req_{i}"] for i in range(len(prompts))]
    compared = 0
    for ours, theirs in zip(outputs["cpu"], outputs["sdpa"], strict=True):
        assert ours.logprobs is not None and len(ours.logprobs) == len(ours.generated_ids) == 24
        for step, (token, logprob) in enumerate(zip(ours.generated_ids, ours.logprobs, strict=True)):
            assert token == theirs.generated_ids[step], (ours.generated_ids, theirs.generated_ids)
            compared += 1
            (_, best), (_, second) = logprob.top
            if best - second < NEAR_TIE:
                break
    assert compared >= len(prompts) * 12  # near-ties are rare: most of the tokens were compared
