"""CUDA Graphs for the decode step, one graph per batch-size bucket.

A decode step of a 7B model is a few hundred small kernel launches; at batch 1-16 launching them
costs about as long as running them. Capturing the step once per bucket (batch sizes 1, 2, 4, 8,
...) and replaying it removes that cost. A graph replays fixed memory addresses, so:
- a batch of n sequences is padded to the smallest bucket >= n (none: the step runs eagerly);
- the step's inputs live in static buffers, allocated once for the largest bucket, that each step
  copies into; every bucket's graph reads views of the same buffers;
- padding rows must be harmless: slot ``PAD_SLOT`` (-1), which the KV store skips (it writes
  nowhere), block table of block 0 and context length 1, so every attention kernel reads one real
  cache row and never softmaxes an empty context; input id 0, position 0.

On the CPU the same bucketing, padding and static buffers run eagerly, so all of it but the
capture itself is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

PAD_SLOT = -1  # KV-store slot of a padding row: skipped by the store kernels, so it writes nowhere
PAD_CONTEXT_LEN = 1  # a padding row attends to one real row (block 0, offset 0), never to nothing
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def choose_bucket(num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket >= num_seqs, or None when the batch is larger than every bucket (run eagerly)."""
    for b in sorted(buckets):
        if b >= num_seqs:
            return b
    return None


def buckets_up_to(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets an engine of ``max_batch`` sequences can use: none past the one that holds
    ``max_batch`` (a graph for 64 rows is wasted memory when at most 5 sequences run)."""
    top = choose_bucket(max_batch, buckets)
    return tuple(b for b in sorted(buckets) if top is None or b <= top)


@dataclass
class DecodeInputs:
    """One decode step's inputs, one row per sequence."""
    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slot_mapping: torch.Tensor  # [n] int64: block * block_size + offset of the new token
    block_tables: torch.Tensor  # [n, width] int
    context_lens: torch.Tensor  # [n] int: tokens in the cache after this step's token is stored

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]


def pad_decode_inputs(inputs: DecodeInputs, bucket: int, max_blocks: int | None = None) -> DecodeInputs:
    """New tensors padded to ``bucket`` rows (and block tables to ``max_blocks`` columns)."""
    n, width = inputs.block_tables.shape
    max_blocks = width if max_blocks is None else max_blocks
    if n > bucket or width > max_blocks:
        raise ValueError(f"a batch of {n} x {width} blocks does not fit {bucket} x {max_blocks}")

    def rows(t, fill):
        return torch.cat([t, t.new_full((bucket - n,), fill)])

    tables = inputs.block_tables.new_zeros(bucket, max_blocks)
    tables[:n, :width] = inputs.block_tables
    return DecodeInputs(rows(inputs.input_ids, 0), rows(inputs.positions, 0), rows(inputs.slot_mapping, PAD_SLOT),
                        tables, rows(inputs.context_lens, PAD_CONTEXT_LEN))


class StaticDecodeBuffers:
    """The step's input buffers, allocated once for the largest bucket; ``fill`` copies a batch in."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device | str, index_dtype=torch.int64):
        self.max_batch, self.max_blocks = max_batch, max_blocks

        def vec(fill):
            return torch.full((max_batch,), fill, dtype=index_dtype, device=device)

        self.full = DecodeInputs(vec(0), vec(0), vec(PAD_SLOT),
                                 torch.zeros(max_batch, max_blocks, dtype=index_dtype, device=device),
                                 vec(PAD_CONTEXT_LEN))

    def view(self, bucket: int) -> DecodeInputs:
        """The first ``bucket`` rows: the same memory every time (what a captured graph reads)."""
        return DecodeInputs(*(getattr(self.full, f.name)[:bucket] for f in fields(DecodeInputs)))

    def fill(self, inputs: DecodeInputs, bucket: int) -> DecodeInputs:
        """Copies ``inputs`` into the first rows and padding into the rest of the bucket."""
        n, width = inputs.block_tables.shape
        if n > bucket or bucket > self.max_batch or width > self.max_blocks:
            raise ValueError(f"a batch of {n} x {width} blocks does not fit bucket {bucket} of "
                             f"{self.max_batch} x {self.max_blocks}")
        out = self.view(bucket)
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", PAD_SLOT),
                          ("context_lens", PAD_CONTEXT_LEN)):
            buf = getattr(out, name)
            buf[:n].copy_(getattr(inputs, name), non_blocking=True)
            buf[n:].fill_(pad)
        out.block_tables[:n, :width].copy_(inputs.block_tables, non_blocking=True)
        out.block_tables[:n, width:].zero_()
        out.block_tables[n:].zero_()
        return out


class GraphRunner:
    """Runs ``step(DecodeInputs) -> Tensor [rows, ...]`` for a decode batch at its bucket's size.

    On CUDA, the first call at a bucket runs the step ``warmup`` times (so triton compiles and
    autotunes outside the capture), captures it into a ``torch.cuda.CUDAGraph`` and replays it
    from then on; ``capture_all`` does that for every bucket up front, largest first, in one shared
    memory pool. On the CPU (or ``use_graphs=False``) the padded step runs eagerly.

    The step must read only its inputs and tensors that stay in place (weights, the KV cache), and
    must not sync with the host (no ``.item()``, no host-side checks). The returned tensor is a
    view of the graph's static output: the next call overwrites it.
    """

    def __init__(self, step: Callable[[DecodeInputs], torch.Tensor], max_blocks: int,
                 device: torch.device | str, buckets: tuple[int, ...] = DEFAULT_BUCKETS, warmup: int = 2,
                 use_graphs: bool | None = None, index_dtype=torch.int64):
        self.step, self.buckets, self.warmup = step, tuple(sorted(buckets)), warmup
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buffers = StaticDecodeBuffers(self.buckets[-1], max_blocks, self.device, index_dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, inputs: DecodeInputs) -> int | None:
        """The bucket this batch runs at, or None when it fits no static buffer (it runs eagerly)."""
        if inputs.block_tables.shape[1] > self.buffers.max_blocks:
            return None
        return choose_bucket(inputs.num_seqs, self.buckets)

    def __call__(self, inputs: DecodeInputs) -> torch.Tensor:
        n = inputs.num_seqs
        bucket = self.bucket(inputs)
        if bucket is None:
            return self.step(inputs)  # larger than any graph: eagerly, unpadded
        static = self.buffers.fill(inputs, bucket)
        if not self.use_graphs:
            return self.step(static)[:n]
        if bucket not in self.graphs:
            self._capture(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]

    def capture_all(self) -> None:
        """Captures every bucket now, on padding-only inputs (they write nowhere), largest first so
        the smaller graphs fit in the memory pool the largest one allocated. Nothing to capture
        without graphs (the CPU, ``use_graphs=False``): the padded step runs eagerly there."""
        if not self.use_graphs:
            return
        for bucket in reversed(self.buckets):
            if bucket not in self.graphs:
                self.buffers.fill(DecodeInputs(*(getattr(self.buffers.full, f.name)[:0]
                                                 for f in fields(DecodeInputs))), bucket)
                self._capture(bucket)

    def _capture(self, bucket: int) -> None:
        static = self.buffers.view(bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.step(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bucket] = self.step(static)
        self.graphs[bucket] = graph
