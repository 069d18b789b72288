"""Decode steps replayed from CUDA graphs: the step's hundreds of kernel launches cost one.

Why: a decode step of a model on a GPU is bound by the host, not the GPU: Python and the launches of
every layer take several times the GPU's own time for the step (measured: docs/benchmarks-log.md). vLLM and SGLang capture the decode step once
per batch size at start-up and replay it; so does this.

How (as vLLM does):
- At start-up, for each batch size in ``capture_sizes`` (1, 2, 4, 8, then every 16 up to ``max_num_seqs``),
  the model's forward over static input buffers is run once (Triton compiles its kernels) and captured.
  All graphs share one memory pool; the largest is captured first.
- A step whose every sequence decodes one token uses the smallest captured size ``B >= n``: the step's
  token ids, positions, KV slots, KV lengths and block tables are copied into the buffers, rows
  ``n..B`` are padding (slot -1: their K/V are not written; KV length 1), and the graph is replayed.
  Its logits ``[B, vocab]`` live in the graph's memory until the next replay.
- Other steps (prefill chunks, mixed batches, more sequences than the largest graph) run eagerly.

The block-table buffer is as wide as the longest sequence allowed (``max_model_len``) so that one graph
serves every context length: the decode kernel reads a sequence's pages only up to its own length.
Decode attention must be a kernel that reads pages through the tables (``engine/executor/attention/triton_decode``):
the SDPA path sizes its gathers from host-side lengths, which a replay cannot change.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache
from scheduler.batch import ScheduledBatch

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # a padding row's KV slot: the kernel's write_kv skips it


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then multiples of 16, up to ``max_num_seqs`` (included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


class CudaGraphDecoder:
    """Captures ``model``'s decode forward for each of ``capture_sizes(max_num_seqs)`` and replays it."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        decode_kernel: DecodeKernel,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.decode_kernel = decode_kernel
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.device = device
        width = -(-max_model_len // block_size)
        self.max_len = width * block_size
        b = self.max_size
        i64 = torch.int64
        self.input_ids = torch.zeros(b, dtype=i64, device=device)
        self.positions = torch.zeros(b, dtype=i64, device=device)
        self.slots = torch.full((b,), PAD_SLOT, dtype=i64, device=device)
        self.seq_lens = torch.ones(b, dtype=i64, device=device)
        self.block_tables = torch.zeros((b, width), dtype=i64, device=device)
        self.rows = torch.arange(b + 1, dtype=i64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _inputs(self, size: int) -> BatchInputs:
        """The model's inputs over the first ``size`` rows of the static buffers (no host data read)."""
        return BatchInputs(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.rows[: size + 1],
            seq_lens=self.seq_lens[:size],
            logits_indices=self.rows[:size],
            max_query_len=1,
            max_seq_len=self.max_len,
            block_size=self.block_size,
            num_decode_seqs=size,
            decode_seq_lens=(self.max_len,) * size,  # sizes the kernel's table slice: the whole width
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):  # the largest first: the others reuse its pool
            inputs = self._inputs(size)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.model(inputs, self.kv_cache, self.decode_kernel)  # compiles the kernels; not captured
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[size] = self.model(inputs, self.kv_cache, self.decode_kernel)  # [size, vocab]
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs of the decode step for %d batch sizes (1..%d) in %.1f s",
            len(self.sizes),
            self.max_size,
            time.perf_counter() - start,
        )

    def can_run(self, batch: ScheduledBatch) -> bool:
        """A step of only one-token decodes, no more sequences than the largest graph."""
        return 0 < len(batch.requests) <= self.max_size and all(s.num_tokens == 1 for s in batch.requests)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits ``[n, vocab]`` (float32) of the batch's sequences, in batch order; valid until the next
        replay."""
        n = len(batch.requests)
        size = next(s for s in self.sizes if s >= n)
        bs = self.block_size
        ids, positions, slots, lens = [], [], [], []
        width = 0
        for s in batch.requests:
            table = s.block_ids
            ids.append(s.token_ids[0])  # its one token
            positions.append(s.start)
            slots.append(table[s.start // bs] * bs + s.start % bs)
            lens.append(s.start + 1)
            width = max(width, len(table))
        pad = size - n
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [PAD_SLOT] * pad, lens + [1] * pad],
            dtype=torch.int64,
        )  # [4, size]
        tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in batch.requests])
        for buffer, row in zip(
            (self.input_ids, self.positions, self.slots, self.seq_lens), host, strict=True
        ):
            buffer[:size].copy_(row, non_blocking=True)
        # NOTE: columns past `width` keep older ids: never read, a sequence's pages end within its own row
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:n]
