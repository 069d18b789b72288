"""bench/decode_phases.py end to end on the default model: the decode stack built with its phase marks runs
the engine's decode steps, and every phase's time a step and share is printed, the shares summing to the
whole; the engine's own build of the stack carries no marks."""

from __future__ import annotations

import ctypes
import re

import pytest

from bench.decode_phases import PHASES, main
from engine.cpu.native_build import KernelUnavailable, build
from engine.executor import decode_stack


def test_prints_every_phase_of_the_decode_steps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        build(decode_stack.SOURCE)
    except KernelUnavailable as e:
        pytest.skip(f"the decode stack cannot be built here: {e}")
    monkeypatch.setattr(
        decode_stack, "load", decode_stack.load
    )  # main swaps the engine's build: undone after
    args = ["--dtype", "float32", "--prompts", "3", "--prompt-len", "8", "--new-tokens", "5", "--runs", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^(\d+) decode steps of 3 sequences", out, re.MULTILINE)
    shares = [float(m) for m in re.findall(r"^\| [^|]+ \| [\d.]+ \| ([\d.]+)% \|$", out, re.MULTILINE)]
    assert len(shares) == len(PHASES) + 1 and shares[-1] == 100.0  # each phase, then the stack
    assert abs(sum(shares[:-1]) - 100.0) < 0.5
    assert all(f"| {name} |" in out for name in PHASES)


def test_the_engines_build_has_no_marks() -> None:
    try:
        lib = decode_stack.load()
    except KernelUnavailable as e:
        pytest.skip(f"the decode stack cannot be built here: {e}")
    assert hasattr(ctypes.CDLL(str(lib.path)), "cbserve_decode_stack")
    assert not hasattr(ctypes.CDLL(str(lib.path)), "cbserve_decode_stack_phases")
