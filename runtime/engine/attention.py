"""Paged attention over the block pool, as the model's attention context for one engine step.

The step's new K/V are written into their slots first; then each query attends to its
sequence's whole context gathered through its block table. Decodes (one query each) are done
together in one call; so are prompt chunks that follow cached tokens (a burst of requests
reusing one cached system prompt): through the chunk kernel (AMX tiles' or the CPU class's), reading the
cache in place, or padded to a common shape for one SDPA call with a causal mask offset by the tokens
already cached. A chunk that starts a sequence goes through the same chunk kernel (over the cache its K/V
were just written to) where there is one, else attends within itself by SDPA. Which kernel reads which
rows is the plan's (runtime/engine/plan.py). A backend is
anything with ``attend(layer, q, k, v)``: a Triton/GPU backend implements the same call. What it
builds (masks, indices, outputs) goes on the device of the tensors it is given. An int8 (quantized)
cache takes the C++ store and decode kernels only, every row a decode row (runtime/engine/model_runner.py);
so does a model with sliding-window layers, whose decode rows then carry their window's first position
(``decode_starts``), read by those layers only. The caller gives each attend its scale (the model
config's: query_pre_attn_scalar for Gemma 2, else head_dim) and its attention logit soft-cap (Gemma 2; 0:
none): the decode kernel and the SDPA paths (explicit scores where there is a cap) apply both; the chunk
and prefill kernels have no cap, so a capped model's chunks never go to them.
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
                 decode_lens: torch.Tensor, decode_kernel=None, store_kv=None, chunk_kernel=None,
                 decode_starts: torch.Tensor | None = None, windowed_layers: tuple[bool, ...] | None = None,
                 one_call: bool = False, bf16_dots: bool = True):
        """``chunk_kernel``: the prompt chunks' (fresh ones and those after cached tokens alike), or None: SDPA.
        ``one_call``: the plan's route for this step (runtime/engine/plan.py): the model hands the whole step to
        the one-call C++ step, which reads this context's tensors. ``bf16_dots`` False: the C++ decode kernel
        reads a bfloat16 cache on its float path (the tuning's ``cpp-float``)."""
        self.one_call, self.bf16_dots = one_call, bf16_dots
        if kv_cache.dtype == torch.int8 and (decode_kernel is None or store_kv is None or prefills):
            # the SDPA paths would need a dequantized copy of the context: the model runner sends every row
            # of an int8 cache through the C++ kernels (ModelRunner's kv_dtype)
            raise ValueError("an int8 KV cache is read by the C++ decode kernel alone (every row a decode row, "
                             "stored first); the SDPA paths take a 16-bit cache: use kv_cache_dtype=bfloat16")
        self.decode_kernel = decode_kernel  # kernels.cpu_attention's, or None: gather + SDPA
        self.store_kv = store_kv  # kernels.cpu_attention's, or None: two index_copy_
        self.decodes_only = not prefills  # the rows are the decodes, in order: no gather, no scatter
        self.kv_cache = kv_cache  # [layers, 2, num_blocks, *kernels/cpu_attention.block_shape]
        self.block_size = block_size
        self.slot_mapping = slot_mapping  # [T] cache slot of each new token
        self.decode_rows = decode_rows  # [D] rows of decode queries
        self.decode_blocks = decode_blocks  # [D, max_blocks]
        self.decode_lens = decode_lens  # [D] context length of each
        # [D] first position each decode row sees in a sliding-window layer (windowed_layers[layer] True)
        self.decode_starts, self.windowed_layers = decode_starts, windowed_layers
        if windowed_layers is not None and (decode_starts is None or prefills):
            raise ValueError("sliding-window layers take decode rows only, each with its window's first position "
                             "(runtime/engine/model_runner.py sends every row of such a model as a decode row)")
        if len(decode_rows) and decode_kernel is None:
            span = torch.arange(decode_blocks.shape[1] * block_size, device=decode_lens.device)
            self.decode_mask = (span[None, :] < decode_lens[:, None])[:, None, None, :]  # [D, 1, 1, S]
            if windowed_layers is not None:
                self.window_mask = self.decode_mask & (span[None, :] >= decode_starts[:, None])[:, None, None, :]
        fresh = [c for c in prefills if c.context == c.length]
        after_cache = [c for c in prefills if c.context > c.length]
        self.fresh = fresh if chunk_kernel is None else []  # SDPA within the chunk, one call each
        # the chunks the chunk kernel reads in place, in one call (a list: none or one such call)
        self.in_place = [_ChunksInPlace(fresh + after_cache, chunk_kernel)] if chunk_kernel is not None and prefills else []
        self.padded = _PaddedChunks(after_cache if chunk_kernel is None else [], block_size, kv_cache.dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               softcap: float = 0.0) -> torch.Tensor:
        """``scale``: the scores' (None: head_dim ** -0.5, SDPA's default); ``softcap`` > 0: scores become
        tanh(score / softcap) * softcap before the softmax."""
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        kvh, d = k.shape[1], k.shape[2]
        kernel_scale = d ** -0.5 if scale is None else scale
        # the decode kernel's keyword arguments: the cap, the float path where chosen, a window's starts (none of
        # them: the kernel's defaults)
        cap = {"softcap": softcap} if softcap else {}
        if not self.bf16_dots:
            cap["bf16_dots"] = False
        if softcap and self.in_place:
            raise ValueError("attention logit soft-capping (Gemma 2) is not implemented in the chunk and prefill "
                             "kernels: such a model's prompt chunks take the decode kernel or SDPA "
                             "(runtime/engine/model_runner.py)")
        if self.store_kv is not None:
            self.store_kv(k_cache, v_cache, self.slot_mapping, k, v)
        else:
            k_cache.view(-1, kvh, d).index_copy_(0, self.slot_mapping, k)
            v_cache.view(-1, kvh, d).index_copy_(0, self.slot_mapping, v)
        windowed = self.windowed_layers is not None and self.windowed_layers[layer]
        if windowed:  # the decode kernel's window starts, in this layer only
            cap["starts"] = self.decode_starts
        if self.decodes_only and self.decode_kernel is not None:
            return self.decode_kernel(q, k_cache, v_cache, self.decode_blocks, self.decode_lens, kernel_scale, **cap)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        group = q.shape[1] // kvh
        for c in self.fresh:  # nothing cached before: attend within the chunk
            rows = slice(c.start, c.start + c.length)
            out[rows] = _causal_chunk(q[rows], k[rows], v[rows], group, scale, softcap)
        for chunks in self.in_place:
            chunks.attend(q, k_cache, v_cache, out, kernel_scale)
        if self.padded.count:
            self.padded.attend(q, k_cache, v_cache, out, scale, softcap)
        if len(self.decode_rows):
            nd = len(self.decode_rows)
            if self.decode_kernel is not None:
                qd = q.index_select(0, self.decode_rows)
                od = self.decode_kernel(qd, k_cache, v_cache, self.decode_blocks, self.decode_lens, kernel_scale, **cap)
                out.index_copy_(0, self.decode_rows, od)
                return out
            # fold the query heads sharing a KV head into the query axis: no K/V repeat for GQA
            qd = q.index_select(0, self.decode_rows).view(nd, kvh, group, d)
            kd = k_cache.index_select(0, self.decode_blocks.flatten()).view(nd, -1, kvh, d).transpose(1, 2)
            vd = v_cache.index_select(0, self.decode_blocks.flatten()).view(nd, -1, kvh, d).transpose(1, 2)
            od = attention(qd, kd, vd, self.window_mask if windowed else self.decode_mask, scale, softcap)
            out.index_copy_(0, self.decode_rows, od.reshape(nd, kvh * group, d))
        return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """SDPA over [..., heads, n, d] (k/v heads may be fewer: GQA) with a boolean or additive mask (None:
    causal), scale None: d ** -0.5; with a soft-cap, explicit scores (tanh(s / cap) * cap, then the mask,
    softmax in float32, as transformers' eager attention computes them), which SDPA cannot do."""
    if not softcap:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=q.shape[-3] != k.shape[-3])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    if q.shape[-3] != k.shape[-3]:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if mask is None:
        n, m = s.shape[-2], s.shape[-1]
        mask = torch.ones(n, m, dtype=torch.bool, device=s.device).tril(m - n)
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float | None = None,
                  softcap: float = 0.0) -> torch.Tensor:
    """Causal attention within one chunk: q, k, v [n, heads, d] -> [n, heads, d]."""
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    return attention(qt, kt, vt, None, scale, softcap)[0].transpose(0, 1)


def _chunk_indices(chunks: list[PrefillChunk]):
    """(block tables [C, width] padded with block 0, first rows, lengths, cached tokens) of chunks."""
    width = max(len(c.blocks) for c in chunks)
    tables = torch.stack([F.pad(c.blocks, (0, width - len(c.blocks))) for c in chunks])
    on = dict(device=tables.device)
    return (tables, torch.tensor([c.start for c in chunks], **on), torch.tensor([c.length for c in chunks], **on),
            torch.tensor([c.context - c.length for c in chunks], **on))


class _ChunksInPlace:
    """Prompt chunks through a chunk kernel (kernels.amx_attention's or kernels.bf16_attention's): each
    chunk reads its context in place through its block table, with no gather and no padding."""

    def __init__(self, chunks: list[PrefillChunk], kernel):
        self.kernel = kernel
        self.tables, self.starts, self.lengths, self.cached = _chunk_indices(chunks)

    def attend(self, q, k_cache, v_cache, out, scale: float) -> None:
        self.kernel(q, k_cache, v_cache, out, self.starts, self.lengths, self.cached, self.tables, scale)


class _PaddedChunks:
    """Prompt chunks that follow cached tokens, padded to one [chunks, heads, rows, keys] SDPA call.

    Masks and indices are built once per step; each layer then gathers K/V by block table and
    makes one call, instead of one small call per chunk (small SDPA calls are mostly overhead)."""

    def __init__(self, chunks: list[PrefillChunk], block_size: int, dtype: torch.dtype):
        self.count = len(chunks)
        if not chunks:
            return
        self.tables, starts, lengths, cached = _chunk_indices(chunks)
        width = self.tables.shape[1]
        n = self.n = max(c.length for c in chunks)
        i = torch.arange(n, device=starts.device)
        valid = i[None, :] < lengths[:, None]  # [C, n]: real query rows
        self.rows = torch.where(valid, starts[:, None] + i[None, :], 0).flatten()  # padding rows read row 0
        self.valid = valid.flatten().nonzero().flatten()
        self.out_rows = self.rows[self.valid]
        keys = torch.arange(width * block_size, device=starts.device)
        # query i of a chunk sees keys up to cached + i; padding rows see key 0 only (no empty softmax).
        # Additive, in the model dtype: SDPA would otherwise convert a boolean mask at every layer.
        visible = keys[None, None, :] <= (cached[:, None] + i[None, :]).masked_fill(~valid, 0)[:, :, None]
        self.mask = torch.zeros(visible.shape, dtype=dtype, device=starts.device).masked_fill_(~visible, float("-inf"))[:, None]

    def attend(self, q, k_cache, v_cache, out, scale: float | None = None, softcap: float = 0.0) -> None:
        c, n, heads, d = self.count, self.n, q.shape[1], q.shape[2]
        kvh = k_cache.shape[2]
        kc = k_cache.index_select(0, self.tables.flatten()).view(c, -1, kvh, d).transpose(1, 2)
        vc = v_cache.index_select(0, self.tables.flatten()).view(c, -1, kvh, d).transpose(1, 2)
        qc = q.index_select(0, self.rows).view(c, n, heads, d).transpose(1, 2)
        o = attention(qc, kc, vc, self.mask, scale, softcap)
        out.index_copy_(0, self.out_rows, o.transpose(1, 2).reshape(c * n, heads, d).index_select(0, self.valid))
