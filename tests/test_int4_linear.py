"""The int4 linear (kernels/csrc/int4_linear.cpp, the active CPU class's build) against a float64 dequantization of the
same weight: symmetric and asymmetric, group sizes 32-128 and per channel, partial column blocks, a
bias, decode rows and prompt-chunk rows; and its refusals of inputs it was not packed for."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import int4_linear
from infer.kernels import isa

MODULE = int4_linear.load()
needs_kernel = pytest.mark.skipif(MODULE is None, reason="this CPU has no AVX2 + FMA: the kernel is never loaded "
                                                         "here; int4 layers run torch's int4 pack (test_quant_runtime)")


def test_the_int4_kernel_is_built_on_every_class_from_avx2():
    assert (MODULE is not None) == isa.at_least("avx2")


@needs_kernel
def test_prompt_chunks_run_on_amx_tiles_exactly_where_the_class_is_amx():
    import subprocess

    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", MODULE.__file__], capture_output=True, text=True,
                             check=True).stdout
    assert ("tdpbf16ps" in listing) == (isa.active() == "amx") == MODULE.prompt_tiles(64, 32)


def _weight(n, k, group, asym, gen):
    groups = k // group
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    zero = torch.randint(-8, 8, (n, groups), dtype=torch.int8, generator=gen) if asym else None
    cols = torch.arange(k) // group
    w = (q.double() - (zero.double()[:, cols] if asym else 0)) * scale.double()[:, cols]
    return q, scale, zero, w


@needs_kernel
@pytest.mark.parametrize("m, n, k, group, asym, bias", [
    (1, 576, 576, 64, False, False),  # a decode row, the embedded model's shapes
    (1, 3072, 576, 64, True, False),
    (3, 100, 192, 32, True, True),  # a partial 32-column block, a bias
    (2, 232, 256, 64, True, True),  # two rows: blocks in twos, an odd one left, a partial block
    (15, 576, 1536, 128, False, True),  # the last row count that splits blocks in advance
    (16, 960, 576, 64, True, False),  # the first that takes work items from the counter
    (100, 40, 256, 256, False, False),  # per channel (one group), prompt-chunk rows
    (141, 100, 192, 32, True, True),  # prompt-chunk rows across the 128-row work item, every tile size, a bias
    (257, 72, 512, 128, True, False),  # two whole work items and one row, a partial block, asymmetric
])
def test_int4_linear_matches_float64(m, n, k, group, asym, bias):
    seed = torch.initial_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    q, scale, zero, w = _weight(n, k, group, asym, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen) if bias else None
    want = x.double() @ w.t() + (b.double() if bias else 0)
    packed, scales, offsets = int4_linear.pack(q, scale, zero)
    got = MODULE.int4_linear(x, packed, scales, offsets, n, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # float32 sums of exact products, one rounding to bfloat16: mostly the exact result's own rounding.
    # The float32 sums carry the 128 + u offset (about 136 x the sum of |x| a group, taken out at the
    # end), so their error is bounded by 2^-24 x K x 136 x sum |x| |s|, under 2^-10 of |x| . |w| here:
    # that, plus one bfloat16 step where the sum lands across a rounding boundary.
    err = (got.double() - want).abs()
    rounding = (want.to(torch.bfloat16).double() - want).abs()
    magnitude = x.double().abs() @ w.abs().t()
    assert (err <= rounding + 1e-6).float().mean() >= 0.99, (err - rounding).max()
    assert (err <= want.abs() * 2.0 ** -7 + magnitude * 2.0 ** -10).all(), (err / magnitude).max()


@needs_kernel
@pytest.mark.parametrize("m, n, k, group, asym", [(141, 100, 192, 32, True), (37, 64, 512, 128, False),
                                                  (20, 232, 256, 64, True), (29, 96, 576, 64, False)])
def test_a_prompt_chunks_rows_are_the_decode_rows_bit_for_bit(m, n, k, group, asym):
    # a prompt chunk widens each block once and sums the same exact products in the same order as a decode
    # step's streaming tiles: every row comes out as it does alone. On AMX tiles (the amx class, 16 rows or more)
    # the tiles sum them in their own order: within the float32 sums' rounding of the row alone instead.
    seed = torch.initial_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    q, scale, zero, w = _weight(n, k, group, asym, gen)
    packed, scales, offsets = int4_linear.pack(q, scale, zero)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen)
    chunk = MODULE.int4_linear(x, packed, scales, offsets, n, b)
    alone = torch.cat([MODULE.int4_linear(x[i:i + 1].contiguous(), packed, scales, offsets, n, b) for i in range(m)])
    if MODULE.prompt_tiles(k, group):
        # the float32 sums carry the 128 + u offset: each within 2^-24 x K x 136 x sum |x| |s| of exact, and the
        # two roundings to bfloat16 one step apart at most where they straddle a boundary
        bound = (x.double().abs() @ w.abs().t()) * 2.0**-10 + alone.double().abs() * 2.0**-7
        assert ((chunk.double() - alone.double()).abs() <= bound).all()
        assert (chunk == alone).float().mean() >= 0.9  # mostly the same rounding
    else:
        assert torch.equal(chunk.view(torch.int16), alone.view(torch.int16))
    for few in (2, 3, 5):  # a few rows (a decode batch, a verify step) give each row its result alone
        part = MODULE.int4_linear(x[:few].contiguous(), packed, scales, offsets, n, b)
        assert torch.equal(part.view(torch.int16), alone[:few].view(torch.int16)), few


@needs_kernel
def test_int4_linear_refuses_what_it_was_not_packed_for():
    gen = torch.Generator().manual_seed(0)
    q, scale, zero, _ = _weight(64, 128, 32, True, gen)
    packed, scales, offsets = int4_linear.pack(q, scale, zero)
    x = torch.randn(2, 128).to(torch.bfloat16)
    cases = {
        r"x has 64 features, the packed weight 128": lambda: MODULE.int4_linear(x[:, :64].contiguous(), packed, scales,
                                                                                 offsets, 64, None),
        r"100 output features do not match": lambda: MODULE.int4_linear(x, packed, scales, offsets, 100, None),
        r"x must be a contiguous \[M, K\] bfloat16": lambda: MODULE.int4_linear(x.float(), packed, scales, offsets, 64,
                                                                                 None),
        r"offsets must be float32 of the scales' shape": lambda: MODULE.int4_linear(x, packed, scales, offsets[:, :2],
                                                                                     64, None),
        r"bias must be a contiguous float32 \[N\]": lambda: MODULE.int4_linear(x, packed, scales, offsets, 64,
                                                                               torch.zeros(63)),
    }
    for pattern, call in cases.items():
        with pytest.raises(RuntimeError, match=pattern):
            call()
    with pytest.raises(ValueError, match="K must be a multiple of 8 x groups"):
        int4_linear.pack(torch.zeros(8, 100, dtype=torch.int8), torch.ones(8, 3), None)


@needs_kernel
@pytest.mark.parametrize("n, k, groups, asym", [(100, 192, 6, True), (576, 576, 9, False), (3, 64, 1, False)])
def test_a_checkpoints_stored_words_pack_as_its_values_do(n, k, groups, asym):
    # a compressed-tensors checkpoint's 4-bit words (compressed-tensors' own packer writes them) repacked word by
    # word, and the values packed, give the layout the kernel's docstring states, written out here nibble by
    # nibble in int64 and word by word; padding columns (u = 8 everywhere) included
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from infer.runtime.model.compressed_tensors import unpack_int32

    seed = torch.initial_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    q[0, :8] = torch.tensor([-8, 7, -8, 7, 0, -1, 1, 7], dtype=torch.int8)  # the extremes, in every place of a word
    scale = torch.rand(n, groups, generator=gen)
    zero = torch.randint(-3, 4, (n, groups), generator=gen).to(torch.int8) if asym else None
    words = pack_to_int32(q, 4)
    assert torch.equal(unpack_int32(words, 4, k), q)  # the reader agrees with the writer
    blocks = -(-n // 32)
    u = torch.full((blocks * 32, k), 8, dtype=torch.int64)
    u[:n] = q.long() + 8
    want = torch.zeros(blocks * 32, k // 8, dtype=torch.int64)
    for j in range(4):
        want |= u[:, 2 * j::8] << (4 * j) | u[:, 2 * j + 1::8] << (16 + 4 * j)
    want = (want - (want >= 2**31) * 2**32).to(torch.int32).view(blocks, 32, k // 8).transpose(1, 2)
    # each pair of groups' words alternate in a block (word i of group g + q at g x words + 2 i + q, g even); an odd
    # count's last group stays as it is
    words_a_group, order = k // 8 // groups, []
    for g in range(0, groups - 1, 2):
        order += [w for i in range(words_a_group) for w in (g * words_a_group + i, (g + 1) * words_a_group + i)]
    order += list(range(len(order), k // 8))
    want = want[:, order]
    from_words = int4_linear.pack_words(words, k, scale, zero)
    from_values = int4_linear.pack(q, scale, zero)
    assert torch.equal(from_words[0], want) and torch.equal(from_values[0], want)
    for a, b in zip(from_words[1:], from_values[1:], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(ValueError, match="do not fit the kernel"):
        int4_linear.pack_words(words[:, :-1], k, scale, zero)
