"""The shape of the production code (issue #20): no function over ~60 lines, so that each reads in one screen.

Kernels written in Triton and declaration lists (Prometheus metrics) are exempt by name: they are long
because they are flat, not because they mix ideas.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "scheduler", "engine", "server", "bench", "cli")
MAX_LINES = 60
EXEMPT = {
    ("engine/executor/attention/triton_decode.py", "_kernels"),  # the Triton kernels' bodies
    ("engine/executor/attention/triton_decode.py", "decode_split"),  # a @triton.jit kernel
    ("engine/executor/attention/triton_decode.py", "__call__"),  # the kernels' launch, argument by argument
    ("server/metrics.py", "__init__"),  # the metric declarations
}


def long_functions(limit: int = MAX_LINES) -> list[tuple[str, str, int]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > limit and (rel, node.name) not in EXEMPT:
                        found.append((rel, node.name, length))
    return found


def test_no_production_function_is_longer_than_a_screen() -> None:
    assert long_functions() == []


def test_the_check_sees_long_functions() -> None:
    # NOTE: the check itself must be able to fail: at a lower limit it finds functions.
    assert long_functions(limit=20)


def test_every_exemption_still_names_a_long_function() -> None:
    present = set()
    for rel, name in EXEMPT:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                if (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_LINES:
                    present.add((rel, name))
    assert present == EXEMPT
