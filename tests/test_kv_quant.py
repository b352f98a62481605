"""The int8 KV cache: the store kernel's quantization and the decode kernel over it, against float64
references computed from the dequantized cache (kernels.cpu_attention.dequantize)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import cpu_attention

from test_kernels import reference


def quantized_paged(seqs, heads, kv_heads, head_dim, block_size=16, num_blocks=48, scale=3.0):
    """A random int8 cache written by store_kv_ (every slot), with random tables and lengths."""
    seed = torch.initial_seed()
    gen = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    k = torch.randn(slots, kv_heads, head_dim, generator=gen) * scale
    v = torch.randn(slots, kv_heads, head_dim, generator=gen) * scale
    kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim + 2, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    cpu_attention.store_kv_(kc, vc, torch.randperm(slots, generator=gen), k.bfloat16(), v.bfloat16())
    lens = torch.randint(1, 6 * block_size, (seqs,), generator=gen)
    lens[0] = 6 * block_size  # one full-width table
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(seqs)])
    q = torch.randn(seqs, heads, head_dim, generator=gen).bfloat16()
    return q, kc, vc, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_quantizes_each_row_within_half_a_step(dtype):
    seed = torch.initial_seed()
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(37, (9 + 3 + 3) * 64, generator=gen) * torch.rand(37, 1, generator=gen) * 20).to(dtype)
    qkv[3] = 0  # an all-zero row: scale 0, values 0
    _, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided slices, as the fused projection gives
    k, v = k.view(37, 3, 64), v.view(37, 3, 64)
    kc = torch.full((4, 16, 3, 66), 99, dtype=torch.int8)
    vc = kc.clone()
    slots = torch.randperm(64, generator=gen)[:37]
    cpu_attention.store_kv_(kc, vc, slots, k, v)
    for cache, x in ((kc, k), (vc, v)):
        rows = cache.view(-1, 3, 66)[slots]
        got = cpu_attention.dequantize(rows).double()
        scale = rows[..., -2:].contiguous().view(torch.bfloat16).double()
        absmax = x.double().abs().amax(-1, keepdim=True)
        # the scale is absmax / 127 rounded to bfloat16 (relative error <= 2^-9), values within +-127
        assert ((scale - absmax / 127).abs() <= absmax / 127 * 2 ** -8 + 1e-30).all()
        assert rows[..., :-2].abs().max() <= 127
        assert ((got - x.double()).abs() <= scale / 2 * (1 + 1e-5) + 1e-30).all()
        assert (got[3] == 0).all()
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert (kc.view(-1, 3, 66)[untouched] == 99).all()  # only the slots written
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_attention.store_kv_(kc[..., :64].contiguous(), vc[..., :64].contiguous(), slots, k, v)


@pytest.mark.parametrize("fixed", [True, False], ids=["registers", "general"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 40)])
def test_decode_on_int8_cache_matches_float64_of_dequantized(fixed, heads, kv_heads, head_dim):
    q, kc, vc, tables, lens = quantized_paged(6, heads, kv_heads, head_dim)
    module = cpu_attention.load()
    module.use_q8_fixed_path(fixed)
    try:
        got = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens, head_dim ** -0.5)
    finally:
        module.use_q8_fixed_path(True)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = reference(q, cpu_attention.dequantize(kc), cpu_attention.dequantize(vc), tables, lens)
    # within the output's bfloat16 rounding (2^-9 relative) and float32 arithmetic's error
    excess = ((got.double() - want).abs() - want.abs() * 2 ** -8).max().item()
    assert excess < 2e-3, excess
    # a row gets the same bits alone as in the batch
    alone = cpu_attention.paged_decode_attention(q[2:3], kc, vc, tables[2:3], lens[2:3], head_dim ** -0.5)
    assert torch.equal(alone, got[2:3])


def test_decode_refuses_a_cache_of_the_wrong_row_size():
    q, kc, vc, tables, lens = quantized_paged(2, 9, 3, 64)
    with pytest.raises(RuntimeError, match="head_dim \\+ 2"):
        cpu_attention.paged_decode_attention(q, kc[..., :65].contiguous(), vc[..., :65].contiguous(), tables, lens, 0.125)
