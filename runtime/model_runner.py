"""Runs one scheduled step: builds the flattened inputs, one forward pass, the rows to sample.

Owns the KV cache: one preallocated tensor for all layers and blocks, never grown or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import PagedAttention, PrefillChunk
from .model import Transformer
from .scheduler import ScheduledBatch
from .sequence import Sequence


def kv_bytes_per_block(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def _attention_kernels(backend: str):
    """(decode attention, KV store) of the compiled CPU kernel: ``auto`` when it builds, ``cpp`` or
    fail; ``torch`` (None, None): gather + SDPA and index_copy_."""
    if backend not in ("auto", "torch", "cpp"):
        raise ValueError(f"attention_backend={backend!r}: choose auto, torch or cpp")
    if backend == "torch":
        return None, None
    from infer.kernels import cpu_attention

    if cpu_attention.load() is None:
        if backend == "cpp":
            raise RuntimeError("attention_backend=cpp but the CPU kernel could not be built (see the warning above)")
        return None, None
    return cpu_attention.paged_decode_attention, cpu_attention.store_kv_


def _chunk_kernel(backend: str, dtype: torch.dtype, head_dim: int, block_size: int):
    """kernels.amx_attention's chunk attention where the CPU has AMX and the cache fits it; else None
    (gather + SDPA). ``torch`` keeps plain torch ops."""
    if backend == "torch":
        return None
    from infer.kernels import amx_attention

    module = amx_attention.load() if amx_attention.fits(dtype, head_dim, block_size) else None
    return module.chunk_attention if module is not None else None


@dataclass
class StepOutput:
    sampled: list[Sequence]  # sequences that reached their last token: one new token each
    logits: torch.Tensor  # [len(sampled), vocab] float32
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits of its chunk rows)


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, attention_backend: str = "auto"):
        cfg = model.config
        self.decode_kernel, self.store_kv = _attention_kernels(attention_backend)
        self.chunk_kernel = _chunk_kernel(attention_backend, model.dtype, cfg.head_dim, block_size)
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
