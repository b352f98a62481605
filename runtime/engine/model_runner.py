"""Runs one scheduled step: builds the flattened inputs, one forward pass, the rows to sample.

Owns the KV cache: one preallocated tensor for all layers and blocks, never grown or copied.
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
class StepOutput:
    sampled: list[Sequence]  # sequences that reached their last token: one new token each
    logits: torch.Tensor  # [len(sampled), vocab] float32
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits of its chunk rows)


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, kernels):
        """``kernels``: the KernelSet the model was loaded with (infer.kernels.resolver)."""
        cfg = model.config
        self.decode_kernel, self.store_kv = kernels.decode_attention, kernels.store_kv
        self.chunk_kernel = kernels.chunk_attention
        self.model = model
        self.block_size = block_size
        self.kv_cache = torch.empty(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=model.dtype)

    def _context(self, batch: ScheduledBatch):
        bs = self.block_size
        ids, positions, slots = [], [], []
        prefills: list[PrefillChunk] = []
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
                prefills.append(PrefillChunk(row, n, end, torch.tensor(table[:-(-end // bs)])))
            row += n
        width = max((len(t) for t in decode_tables), default=0)
        blocks = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long).view(len(decode_tables), width)
        ctx = PagedAttention(self.kv_cache, bs, torch.tensor(slots), prefills, torch.tensor(decode_rows, dtype=torch.long),
                             blocks, torch.tensor(decode_lens, dtype=torch.long), self.decode_kernel, self.store_kv,
                             self.chunk_kernel)
        return torch.tensor(ids), torch.tensor(positions), ctx

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        input_ids, positions, ctx = self._context(batch)
        hidden = self.model(input_ids, positions, ctx)
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
