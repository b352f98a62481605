"""Paged decode attention (one query token per sequence) straight over the block tables, in triton.

The contract of ``kernels.cpu_attention.paged_decode_attention``: q [seqs, heads, d], caches
[num_blocks, block_size, kv_heads, d], block_tables [seqs, max_blocks] int, context_lens [seqs] int,
-> out [seqs, heads, d] in q's dtype. Accumulation is float32 whatever the cache dtype.

One program per (sequence, KV head, split): the query heads that share a KV head (GQA) are scored
together as the rows of one ``tl.dot``, so each K/V row is read from memory once for the whole
group. Tokens are visited BLOCK_N at a time through the block table (any page size), with an
online softmax. With ``splits`` > 1 (flash-decoding) each sequence's context is cut into that many
chunks handled by separate programs, which keeps the GPU busy at batch 1-4; a second small kernel
merges the chunks by their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import FP32_DOT, check_device, configs, do_bench, dot, next_power_of_2

_GPU_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bn, w, s in [(16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 8, 3), (128, 4, 2), (128, 8, 3)]]
_INTERPRETER_CONFIGS = [triton.Config({"BLOCK_N": 16}), triton.Config({"BLOCK_N": 32})]


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, scale,
                   stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_ts, stride_os, stride_oh,
                   group, head_dim, num_heads, BLOCK_SIZE: tl.constexpr,
                   GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, FP32_DOT: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    # split boundaries on BLOCK_N boundaries, so every split but the last sees whole tiles
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # m starts finite: a tile whose scores are all -inf then gives exp(-inf) = 0, never inf - inf
    m = tl.full([GROUP_PAD], -1e30, tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_ts
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_kb + (n % BLOCK_SIZE) * stride_kt + kvh * stride_kh  # [BLOCK_N]
        k = tl.load(k_ptr + row[None, :] + d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        s = dot(q, k, FP32_DOT) * scale  # [GROUP_PAD, BLOCK_N], float32
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, FP32_DOT)
        m = m_new

    denom = tl.where(row_sum > 0, row_sum, 1.0)
    out = acc / denom[:, None]  # an empty context (or split) gives zeros
    mask = g_mask[:, None] & d_mask[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        slot = (seq.to(tl.int64) * num_heads + head) * SPLITS + split  # [GROUP_PAD]
        tl.store(part_ptr + slot[:, None] * D_PAD + d[None, :], out, mask=mask)
        tl.store(lse_ptr + slot, tl.where(row_sum > 0, m + tl.log(denom), float("-inf")), mask=g_mask)


_decode_tuned = triton.autotune(configs=configs(_GPU_CONFIGS, _INTERPRETER_CONFIGS),
                                key=["group", "head_dim", "BLOCK_SIZE", "SPLITS"], do_bench=do_bench)(_decode_kernel)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, stride_os, stride_oh, num_heads, head_dim,
                         SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """out = sum_s exp(lse_s - max) * part_s / sum_s exp(lse_s - max), per (sequence, head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    base = (seq.to(tl.int64) * num_heads + head) * SPLITS
    lse = tl.load(lse_ptr + base + s, mask=s < SPLITS, other=float("-inf"))
    top = tl.maximum(tl.max(lse, 0), -1e30)  # finite: empty splits (lse -inf) weigh exp(-inf) = 0
    w = tl.exp(lse - top)
    total = tl.sum(w, 0)
    part = tl.load(part_ptr + (base + s)[:, None] * D_PAD + d[None, :],
                   mask=(s < SPLITS)[:, None] & (d < head_dim)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


def default_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, but no split shorter than 128 tokens (on
    an H200, batch 1 at 1,024 tokens: 11.0 us at 4 splits, 7.7 at 8; bench/device_check.py).

    Decided from shapes only (the block table's width bounds the context), never from the
    context lengths' values: no device sync, and the same choice inside a CUDA graph."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(2 * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_context // 128, 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, splits: int | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """q [seqs, heads, d]; caches [blocks, block_size, kv_heads, d]; returns [seqs, heads, d].

    ``splits``: chunks per sequence (None: ``default_splits``). ``config`` ({"BLOCK_N": ..}) runs
    that tile size instead of the autotuned one (tests cover each config this way)."""
    check_device(q, k_cache, v_cache, block_tables, context_lens)
    seqs, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"head layout mismatch: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q's rows and the KV caches must be contiguous")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError("q and the caches must share a dtype")
    block_tables = block_tables.contiguous()
    if splits is None:
        splits = default_splits(seqs, kv_heads, block_tables.shape[1] * block_size, q.device)
    out = torch.empty(seqs, heads, d, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    d_pad = max(16, next_power_of_2(d))
    if splits > 1:
        part = torch.empty(seqs, heads, splits, d_pad, dtype=torch.float32, device=q.device)
        lse = torch.empty(seqs, heads, splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # not read: the kernel writes the output directly
    args = (q, k_cache, v_cache, block_tables, context_lens, out, part, lse, float(scale),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), group, d, heads)
    meta = dict(BLOCK_SIZE=block_size, GROUP_PAD=max(16, next_power_of_2(group)), D_PAD=d_pad, SPLITS=splits,
                FP32_DOT=FP32_DOT)
    grid = (seqs, kv_heads, splits)
    if config is None:
        _decode_tuned[grid](*args, **meta)
    else:
        _decode_kernel[grid](*args, **meta, **config)
    if splits > 1:
        _merge_splits_kernel[(seqs, heads)](part, lse, out, out.stride(0), out.stride(1), heads, d,
                                            SPLITS=splits, SPLITS_PAD=next_power_of_2(splits), D_PAD=d_pad)
    return out


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                     acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain torch: gather each sequence's context, softmax(q k^T * scale) v in ``acc_dtype``."""
    seqs, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(seqs, heads, d, dtype=acc_dtype, device=q.device)
    for i in range(seqs):
        n = int(context_lens[i])
        if n == 0:
            continue
        blocks = block_tables[i, :triton.cdiv(n, block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, d)[:n].to(acc_dtype)
        v = v_cache[blocks].reshape(-1, kv_heads, d)[:n].to(acc_dtype)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # [n, heads, d]
        scores = torch.einsum("hd,nhd->hn", q[i].to(acc_dtype), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out.to(q.dtype)
