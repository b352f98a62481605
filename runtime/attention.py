"""Paged attention over the block pool, as the model's attention context for one engine step.

The step's new K/V are written into their slots first; then each query attends to its
sequence's whole context gathered through its block table. Decodes (one query each) are done
together in one call; prompt chunks one sequence at a time, with a causal mask offset by the
tokens already cached. A backend is anything with ``attend(layer, q, k, v)``: a Triton/GPU
backend implements the same call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # row of its first query in the step's flattened tokens
    length: int  # query tokens this step
    context: int  # tokens of the sequence in cache after this step (cached prefix + this chunk)
    blocks: torch.Tensor  # block ids covering the context


class PagedAttention:
    def __init__(self, kv_cache: torch.Tensor, block_size: int, slot_mapping: torch.Tensor,
                 prefills: list[PrefillChunk], decode_rows: torch.Tensor, decode_blocks: torch.Tensor,
                 decode_lens: torch.Tensor, decode_kernel=None):
        self.decode_kernel = decode_kernel  # kernels.cpu_attention's, or None: gather + SDPA
        self.kv_cache = kv_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.slot_mapping = slot_mapping  # [T] cache slot of each new token
        self.prefills = prefills
        self.decode_rows = decode_rows  # [D] rows of decode queries
        self.decode_blocks = decode_blocks  # [D, max_blocks]
        self.decode_lens = decode_lens  # [D] context length of each
        if len(decode_rows) and decode_kernel is None:
            span = torch.arange(decode_blocks.shape[1] * block_size)
            self.decode_mask = (span[None, :] < decode_lens[:, None])[:, None, None, :]  # [D, 1, 1, S]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        kvh, d = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, d).index_copy_(0, self.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        group = q.shape[1] // kvh
        for c in self.prefills:
            qc = q[c.start:c.start + c.length]
            if c.context == c.length:  # nothing cached before: attend within the chunk
                kc, vc = k[c.start:c.start + c.length], v[c.start:c.start + c.length]
            else:
                kc = k_cache.index_select(0, c.blocks).view(-1, kvh, d)[:c.context]
                vc = v_cache.index_select(0, c.blocks).view(-1, kvh, d)[:c.context]
            out[c.start:c.start + c.length] = _causal_chunk(qc, kc, vc, group)
        if len(self.decode_rows):
            nd = len(self.decode_rows)
            if self.decode_kernel is not None:
                qd = q.index_select(0, self.decode_rows)
                od = self.decode_kernel(qd, k_cache, v_cache, self.decode_blocks, self.decode_lens, d ** -0.5)
                out.index_copy_(0, self.decode_rows, od)
                return out
            # fold the query heads sharing a KV head into the query axis: no K/V repeat for GQA
            qd = q.index_select(0, self.decode_rows).view(nd, kvh, group, d)
            kd = k_cache.index_select(0, self.decode_blocks.flatten()).view(nd, -1, kvh, d).transpose(1, 2)
            vd = v_cache.index_select(0, self.decode_blocks.flatten()).view(nd, -1, kvh, d).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask)
            out.index_copy_(0, self.decode_rows, od.reshape(nd, kvh * group, d))
        return out


def _causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """q: [n, heads, d] for the last n positions of a context of len(k): causal attention."""
    n, ctx = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n == ctx:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=group > 1)
    else:
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=group > 1)
    return o[0].transpose(0, 1)
