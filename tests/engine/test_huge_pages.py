"""Large CPU tensors on transparent huge pages (engine/cpu/huge_pages.py): alignment, shapes, one allocation for
many, and that the kernel really backs them with 2 MiB pages where THP is on (read from /proc/self/smaps);
the KV cache and the small kernel's packed weights use them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.cpu import huge_pages
from engine.executor.fast_paths import apply_cpu_fast_paths
from engine.executor.kernels import prepacked, small_gemm
from engine.executor.kernels.modules import SmallGemmLinear
from engine.executor.kv_cache import KVCache
from engine.executor.models.registry import build_model
from engine.loader.dummy import get_preset

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed THP mode (always, madvise, never), or None where there is no THP."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` in /proc/self/smaps."""
    current = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_empty_is_aligned_and_shaped() -> None:
    t = huge_pages.empty((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    if huge_pages.MADV_HUGEPAGE is not None:
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * 3 * (1 << 20)
    small = huge_pages.empty((10, 10), torch.bfloat16)  # under 2 MiB: a plain tensor
    assert small.shape == (10, 10) and small.dtype == torch.bfloat16


def test_empty_many_is_one_allocation_of_disjoint_contiguous_tensors() -> None:
    shapes = [(4, 100, 16), (7, 3), (1 << 19,)]
    ts = huge_pages.empty_many(shapes, torch.float32)
    assert [tuple(t.shape) for t in ts] == shapes and all(t.is_contiguous() for t in ts)
    assert len({t.untyped_storage().data_ptr() for t in ts}) == 1
    for i, t in enumerate(ts):
        t.fill_(i)
    assert [t.unique().tolist() for t in ts] == [[0.0], [1.0], [2.0]]  # nothing overlaps


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_memory_is_backed_by_huge_pages() -> None:
    for _ in range(3):  # freed heap memory, already touched, is what it must not be given
        torch.empty(18 << 20, dtype=torch.uint8).fill_(7)
    t = huge_pages.empty((16 << 20,), torch.uint8)
    assert not t.any()  # fresh memory
    t.fill_(1)  # first touch: the kernel faults in 2 MiB pages
    assert anon_huge_kb(t.data_ptr()) >= 2048


@pytest.mark.slow  # a model of SmolLM2's width, prepacked
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_the_cpu_kv_cache_and_packed_weights_are_on_huge_pages() -> None:
    cache = KVCache(4, 256, 16, 2, 64, torch.float32, "cpu")  # 8 MiB, zeroed
    assert cache.kv.data_ptr() % huge_pages.HUGE_PAGE == 0 and not cache.kv.any()
    assert anon_huge_kb(cache.kv.data_ptr()) >= 2048
    if not prepacked.can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    cfg = dataclasses.replace(get_preset("smollm2-135m"), num_hidden_layers=2)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if apply_cpu_fast_paths(model).small_gemm is None:
        pytest.skip("the small-batch matmul kernel is not used here")
    packed = [m.panels for m in model.modules() if isinstance(m, SmallGemmLinear)]
    assert len(packed) == 4 * cfg.num_hidden_layers + 1  # the projections and the output head
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1  # one allocation
    head = model.lm_head
    assert isinstance(head, SmallGemmLinear)
    assert anon_huge_kb(head.panels.data_ptr()) >= 2048
    assert small_gemm.SmallGemm.packed_shape(cfg.vocab_size, cfg.hidden_size) == tuple(head.panels.shape)
