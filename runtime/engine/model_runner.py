"""Runs one scheduled step: builds the flattened inputs, one forward pass, the rows to sample.

Owns the KV cache: one preallocated tensor for all layers and blocks, never grown or copied.
A step is split in two so that tensor parallelism (runtime/parallel) can share it: ``prepare``
turns the scheduled batch into ``StepInputs`` (tensors only; rank 0 broadcasts them as they are),
and ``forward`` runs the model on them, the same code on every rank over its own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import PagedAttention, PrefillChunk
from ..model import Transformer
from .scheduler import ScheduledBatch
from .sequence import Sequence


def kv_bytes_per_block(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


@dataclass
class StepInputs:
    """What one step's forward pass needs, as int64 tensors: no Sequence objects, so it can travel."""
    input_ids: torch.Tensor  # [T] the step's tokens, flattened over its sequences
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] the KV cache slot each token's K/V goes to
    chunk_starts: torch.Tensor  # [P] first row of each prompt chunk
    chunk_lengths: torch.Tensor  # [P] its tokens this step
    chunk_contexts: torch.Tensor  # [P] its sequence's tokens in cache after this step
    chunk_blocks: torch.Tensor  # [P, W] block tables covering those contexts, padded with block 0
    decode_rows: torch.Tensor  # [D] rows of the single-token decodes
    decode_blocks: torch.Tensor  # [D, W'] their block tables, padded with block 0
    decode_lens: torch.Tensor  # [D] their context lengths
    decode_kernel: bool = True  # the C++ paged decode kernel (False: gather + SDPA, the tuning's choice)


@dataclass
class StepOutput:
    sampled: list[Sequence]  # sequences that reached their last token: one new token each
    logits: torch.Tensor  # [len(sampled), vocab] float32
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits of its chunk rows)


class ModelRunner:
    error: str | None = None  # set by a runner that can no longer step (a tensor-parallel rank died)
    max_threads: int | None = None  # a cap on the tuning table's threads (ranks sharing the cores)

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, kernels, tuning=None):
        """``kernels``: the KernelSet the model was loaded with (infer.kernels.resolver); ``tuning``: a
        runtime.tuning.Tuning for this machine, whose per-bucket choices (decode attention kernel,
        threads) each step follows."""
        cfg = model.config
        self.decode_kernel, self.store_kv = kernels.decode_attention, kernels.store_kv
        self.chunk_kernel = kernels.chunk_attention
        self.tuning = tuning
        self.default_threads = torch.get_num_threads()
        self.model = model
        self.block_size = block_size
        # zeros, not torch.empty's stale memory (which can hold NaN: the SDPA paths weight padding and slots
        # past a sequence's end by 0, and 0 x NaN would fail a request); writing it also touches every page
        # now, at load, rather than during the first requests
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=model.dtype)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The scheduled batch as flattened tensors: tokens, positions, slots, chunks and decodes."""
        bs = self.block_size
        ids, positions, slots = [], [], []
        chunks, chunk_tables = [], []
        decode_rows, decode_tables, decode_lens = [], [], []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = start + n
            pos = range(start, end)
            ids.extend(seq.token_ids[start:end])
            positions.extend(pos)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(table[:-(-end // bs)])
                decode_lens.append(end)
            else:
                chunks.append((row, n, end))
                chunk_tables.append(table[:-(-end // bs)])
            row += n
        decode_kernel = True
        if self.tuning is not None and decode_rows and self.tuning.decode_attention(len(decode_rows)) == "torch-sdpa":
            decode_kernel = False  # the table measured gather + SDPA faster at this many decodes
        chunk_info = torch.tensor(chunks, dtype=torch.long).view(len(chunks), 3)
        return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                          torch.tensor(slots, dtype=torch.long), chunk_info[:, 0], chunk_info[:, 1],
                          chunk_info[:, 2], _padded(chunk_tables), torch.tensor(decode_rows, dtype=torch.long),
                          _padded(decode_tables), torch.tensor(decode_lens, dtype=torch.long), decode_kernel)

    def _context(self, inputs: StepInputs) -> PagedAttention:
        bs = self.block_size
        prefills = [PrefillChunk(start, length, context, inputs.chunk_blocks[i, :-(-context // bs)])
                    for i, (start, length, context) in enumerate(zip(inputs.chunk_starts.tolist(),
                                                                     inputs.chunk_lengths.tolist(),
                                                                     inputs.chunk_contexts.tolist()))]
        return PagedAttention(self.kv_cache, bs, inputs.slots, prefills, inputs.decode_rows, inputs.decode_blocks,
                              inputs.decode_lens, self.decode_kernel if inputs.decode_kernel else None,
                              self.store_kv, self.chunk_kernel)

    def _threads(self, rows: int) -> None:
        """The table's thread count for a step of this many rows (the process default without one)."""
        want = (self.tuning.threads(rows) if self.tuning is not None else None) or self.default_threads
        if self.max_threads is not None:
            want = min(want, self.max_threads)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over one step's inputs: final hidden states [T, hidden]. Every rank runs this."""
        self._threads(len(inputs.input_ids))
        return self.model(inputs.input_ids, inputs.positions, self._context(inputs))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        hidden = self.forward(self.prepare(batch))
        rows, sampled = [], []
        prompt_logits = {}
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                prompt_logits[seq.seq_id] = (start, self.model.compute_logits(hidden[row:row + n]))
            if start + n == len(seq):
                rows.append(row + n - 1)
                sampled.append(seq)
            row += n
        logits = self.model.compute_logits(hidden[rows]) if rows else torch.empty(0)
        return StepOutput(sampled, logits, prompt_logits)

    def close(self) -> None:
        """Releases what the runner holds beyond memory (a tensor-parallel runner: its ranks)."""


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [n, widest] tensor, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(len(tables), width)
