"""bfloat16 linears with prepacked weights (AMX tiles, column blocks, oneDNN) against a float64
reference, and in the model."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from infer.kernels import amx_linear, bf16_linear
from infer.kernels.onednn import can_pack
from infer.kernels import isa
from infer.runtime.model.packed_linear import PackedLinear, pack_linears

AMX = amx_linear.load()
BF16 = bf16_linear.load()
MODULES = {"amx": AMX, "blocks": BF16}


def test_packing_is_available_wherever_onednn_is():
    # oneDNN's bfloat16 linear needs AVX-512 (on AVX2 it has none: the column blocks run there)
    assert can_pack(torch.bfloat16) == (torch.backends.mkldnn.is_available() and isa.at_least("avx512"))
    assert not can_pack(torch.float32)  # measured slower: left to F.linear


def test_amx_kernel_is_used_wherever_the_cpu_has_amx():
    # a CPU with AMX and a compiler: a missing kernel is a failure, not a fallback to accept; a class forced
    # below amx (INFER_ISA, INFER_AMX=0) has none
    from infer.kernels import isa

    assert (AMX is not None) == (torch.cpu._is_amx_tile_supported() and isa.active() == "amx")


def test_column_block_kernel_is_built_on_every_class_from_avx2():
    assert (BF16 is not None) == isa.at_least("avx2")


def _kernels():
    return [pytest.param("onednn", marks=pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN has no bfloat16 linear on this CPU class (it needs AVX-512): the blocks case ran")),
            pytest.param("blocks", marks=pytest.mark.skipif(BF16 is None, reason="this CPU has no AVX2 + FMA: that kernel cannot run here; the onednn case ran")),
            pytest.param("amx", marks=pytest.mark.skipif(AMX is None, reason="this CPU has no AMX: the AMX kernel cannot run here; the other kernels ran"))]


def _random_linear(n: int, k: int, bias: bool, gen) -> nn.Linear:
    linear = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
    if bias:
        linear.bias.copy_(torch.randn(n, generator=gen))
    return linear


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 9, 12, 13, 16, 33, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_packed_linear_matches_float64(kernel, rows, bias, wide):
    gen = torch.Generator().manual_seed(torch.initial_seed())
    # 1536 inputs: 300 rows span two of the AMX kernel's row blocks. The column-block kernel packs
    # 96 outputs in three 32-column blocks (AVX-512 BF16 row tiles 12, 4, 2, 1; widening ones 8 or 4, 2, 1)
    # and 1100 in 64-column ones, the last one part full (row tiles 6, 4, 2, 1); 1088 for AMX, which needs whole 32-column tiles
    n = (1088 if kernel == "amx" else 1100) if wide else 96
    linear = _random_linear(n, 1536 if rows == 300 else 192, bias, gen)
    packed = PackedLinear(linear, kernel, MODULES.get(kernel))
    assert packed.kernel == kernel
    x = torch.randn(rows, linear.in_features, generator=gen).to(torch.bfloat16)
    want = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 accumulation rounded once to bfloat16: within a bf16 ulp or two of the exact result
    scale = want.abs().max().item()
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2 * scale)
    assert torch.allclose(got.float(), linear(x).float(), rtol=1e-2, atol=1e-2 * scale)
    # float_out (the LM head's logits): amx and blocks return their float32 sums unrounded, within float32
    # accumulation error of the exact result (far inside a bfloat16 step), and rounding them gives the bfloat16
    # output; oneDNN's rounded output comes back widened
    sums = packed(x, float_out=True)
    assert sums.dtype == torch.float32 and sums.shape == (rows, n)
    if kernel == "onednn":
        assert torch.equal(sums, got.float())
    else:
        bound = linear.in_features * 2.0 ** -23 * (x.double().abs() @ linear.weight.double().abs().t()
                                                   + (linear.bias.double().abs() if bias else 0)) + 1e-30
        assert ((sums.double() - want).abs() <= bound).all(), f"worst {((sums.double() - want).abs() / bound).max():.3g} of the bound"
        assert torch.equal(sums.bfloat16(), got)


@pytest.mark.skipif(AMX is None, reason="this CPU has no AMX: the AMX kernel cannot run here")
def test_amx_linear_takes_strided_rows_and_falls_back_on_shapes_it_cannot_tile():
    gen = torch.Generator().manual_seed(torch.initial_seed())
    linear = _random_linear(64, 96, True, gen)
    wide = torch.randn(5, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, 3:99]  # rows 200 apart, as a slice of a fused projection's output is
    want = x.double() @ linear.weight.double().t() + linear.bias.double()
    got = PackedLinear(linear, "amx", AMX)(x)
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    # 70 rows on cache lines are read in place (64) and from a copy (6); the same rows 2 bytes off a line, all from
    # a copy: the same bits either way
    packed = PackedLinear(linear, "amx", AMX)
    rows = torch.randn(70, 96, generator=gen).to(torch.bfloat16)
    shifted = torch.empty(70 * 96 + 1, dtype=torch.bfloat16)[1:].view(70, 96)
    shifted.copy_(rows)
    assert rows.data_ptr() % 64 == 0 and shifted.data_ptr() % 64 != 0
    assert torch.equal(packed(rows), packed(shifted))
    assert torch.equal(packed(rows[40:]), packed(rows)[40:])  # a partial tail alone
    # 80 outputs are not a multiple of 32: pack_linears leaves that layer to the next kernel that fits
    model = _tiny_model(80)
    pack_linears(model, AMX, bf16=None)
    assert model.layers[0].mlp.down_proj.kernel == "onednn"


@pytest.mark.skipif(BF16 is None, reason="this CPU has no AVX2 + FMA: that kernel cannot run here")
def test_column_block_linear_takes_strided_rows_and_checks_its_inputs():
    gen = torch.Generator().manual_seed(torch.initial_seed())
    linear = _random_linear(130, 96, True, gen)  # 130 outputs: four whole 32-column blocks and 2 columns of a fifth
    packed = PackedLinear(linear, "blocks", BF16)
    wide = torch.randn(9, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, 3:99]  # rows 200 apart, as a slice of a fused projection's output is
    want = x.double() @ linear.weight.double().t() + linear.bias.double()
    got = packed(x)
    assert got.shape == (9, 130)
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    with pytest.raises(RuntimeError, match="97 features"):
        BF16.bf16_linear(torch.zeros(2, 97, dtype=torch.bfloat16), packed.packed_weight, 130, None)
    with pytest.raises(RuntimeError, match="do not match"):
        BF16.bf16_linear(x.contiguous(), packed.packed_weight, 200, None)
    with pytest.raises(RuntimeError, match="float32"):
        BF16.bf16_linear(x.contiguous(), packed.packed_weight, 130, linear.bias)  # bf16 bias: refused
    assert not bf16_linear.fits(torch.zeros(8, 7, dtype=torch.bfloat16))  # odd K: stays on oneDNN


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_column_block_linear_rounds_as_torch_including_nan_and_inf(rows):
    """Each output rounded once to bfloat16 as torch rounds the float32 sums (to nearest even; NaN stays NaN,
    infinities kept), whole vectors in registers and a last part-full block's columns one by one."""
    gen = torch.Generator().manual_seed(torch.initial_seed())
    print("seed", torch.initial_seed())
    linear = _random_linear(100, 64, True, gen)  # a 64-column block and 36 columns of a second
    packed = PackedLinear(linear, "blocks", BF16)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    x[0, 5] = float("nan")  # row 0: every output NaN
    if rows > 1:
        x[1] = 0
        x[1, 0] = float("inf")  # row 1: +-inf where the weight's sign says
    got, sums = packed(x), packed(x, float_out=True)
    nan = torch.isnan(got)
    assert nan[0].all() and torch.equal(nan, torch.isnan(sums))
    bits = lambda t: t.view(torch.int16)  # (torch's vectorized rounding gives NaN other bits than its scalar one)
    assert torch.equal(bits(sums.bfloat16())[~nan], bits(got)[~nan])
    if rows > 1:
        assert torch.isinf(got[1]).all() and torch.equal(torch.sign(got[1].float()), torch.sign(linear.weight[:, 0].float()))


def _tiny_model(intermediate: int = 128):
    from infer.runtime.model import ModelConfig, Transformer

    cfg = ModelConfig("llama", 320, 64, intermediate, 2, 4, 2, 16, 1e-5, 10000.0, 128, True, False)
    model = Transformer(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.2)
    model.lm_head.weight = model.embed_tokens.weight  # tied, as in the embedded model
    return model


def _picks_a_top_token(after: torch.Tensor, before: torch.Tensor) -> None:
    """Every position's greedy token is one the unpacked model scores highest: bfloat16 logits over 320 words
    often tie exactly (e.g. 0.7031 twice), and a tie may break either way; a wrong pick scores below the top."""
    picked = before.gather(-1, after.argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(picked, before.amax(-1)), (picked, before.amax(-1))


@pytest.mark.parametrize("kernel", _kernels())
def test_pack_linears_swaps_the_decoder_linears_and_with_amx_or_blocks_the_lm_head(kernel):
    model = _tiny_model()
    ids = torch.randint(0, 320, (1, 12))
    with torch.inference_mode():
        before = model.logits(ids)
    streams = kernel != "onednn"  # a kernel that streams the weights takes the LM head too
    assert pack_linears(model, AMX if kernel == "amx" else None, bf16=BF16 if kernel == "blocks" else None) \
        == 2 * 4 + streams
    assert model.layers[1].mlp.down_proj.kernel == kernel
    assert type(model.lm_head) is (PackedLinear if streams else nn.Linear)
    assert model.embed_tokens.weight.shape == (320, 64)  # lookups keep the plain embedding
    with torch.inference_mode():
        after = model.logits(ids)
    assert (after - before).abs().max().item() < 0.05 * before.abs().max().item()
    _picks_a_top_token(after, before)


def test_streamed_weights_share_one_aligned_arena_and_keep_their_values():
    from infer.kernels import hugepages

    memory = hugepages.arena(5 << 20)
    assert memory.data_ptr() % hugepages.HUGE == 0 and memory.numel() == 5 << 20
    kernel = "amx" if AMX is not None else "blocks" if BF16 is not None else None
    if kernel is None:
        pytest.skip("this CPU has neither AMX nor AVX2 + FMA: no weights are streamed from an arena here")
    model = _tiny_model()
    ids = torch.randint(0, 320, (1, 12))
    with torch.inference_mode():
        before = model.logits(ids)
    pack_linears(model, AMX, bf16=BF16)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    storages = {m.packed_weight.untyped_storage().data_ptr() for m in packed}
    assert len(packed) == 9 and len(storages) == 1  # 8 decoder linears and the LM head, one arena
    with torch.inference_mode():
        after = model.logits(ids)
    _picks_a_top_token(after, before)
    assert (after - before).abs().max().item() < 0.05 * before.abs().max().item()


def _mapping_of(ptr: int) -> dict[str, str]:
    """/proc/self/smaps' entry for the mapping holding address ``ptr``: its path and its fields."""
    import re

    found = None
    for line in open("/proc/self/smaps"):
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)", line)
        if head:
            if found is not None:
                return found
            if int(head.group(1), 16) <= ptr < int(head.group(2), 16):
                found = {"path": head.group(3)}
        elif found is not None and ":" in line:
            key, value = line.split(":", 1)
            found[key] = value.strip()
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and /proc/self/smaps are Linux's")
def test_an_arena_is_its_own_fresh_mapping_on_huge_pages_even_after_the_heap_freed_memory():
    """Loading frees the checkpoint's tensors just before packing: an arena taken from the allocator then reused
    heap pages already faulted in small, where MADV_HUGEPAGE came too late (a W8A8 model's LM head streamed
    at ~0.7x). The arena is a mapping of its own, on huge pages wherever the system allows them, and goes
    away with its last view."""
    import gc

    from infer.kernels import hugepages

    # 48 MB of the heap touched (pieces below malloc's mmap threshold), kept from being trimmed by a tensor taken
    # after them, then freed: malloc serves a large request from such a free heap chunk before it maps new memory
    pieces = [torch.ones(96 << 10, dtype=torch.uint8) for _ in range(512)]
    pin = torch.ones(16, dtype=torch.uint8)
    del pieces
    memory = hugepages.arena(16 << 20)
    memory.fill_(7)
    mapping = _mapping_of(memory.data_ptr())
    assert mapping["path"] == "", mapping  # anonymous and private: not [heap], not a /dev/zero share
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" not in thp:
        assert int(mapping["AnonHugePages"].split()[0]) >= 2048, (thp, mapping)
    assert memory[::4096].eq(7).all()
    view = memory[100:200]
    start = memory.data_ptr()
    del memory
    gc.collect()
    assert _mapping_of(start) is not None  # a view keeps it
    assert view.eq(7).all()
    del view
    gc.collect()
    assert _mapping_of(start) is None
    assert pin.sum() == 16


@pytest.mark.parametrize("kernel", _kernels())
def test_packing_lets_each_plain_weight_go_as_it_goes(kernel, monkeypatch):
    """A 7B bfloat16 model loads in about its own size: each plain weight is freed once packed, not all of
    them kept until the last is packed (the bfloat16 7B baseline was killed by the kernel at 24 GB that way)."""
    import gc
    import weakref

    import infer.runtime.model.packed_linear as packed

    model = _tiny_model()
    plain = [weakref.ref(m.weight) for layer in model.layers for m in layer.modules() if type(m) is nn.Linear]
    alive_at_each_pack = []
    real = packed.PackedLinear.__init__

    def counting(self, *args, **kwargs):
        gc.collect()
        alive_at_each_pack.append(sum(r() is not None for r in plain))
        real(self, *args, **kwargs)

    monkeypatch.setattr(packed.PackedLinear, "__init__", counting)
    pack_linears(model, AMX if kernel == "amx" else None, bf16=BF16 if kernel == "blocks" else None)
    n = len(plain)
    assert alive_at_each_pack[:n] == list(range(n, 0, -1)), alive_at_each_pack
    gc.collect()
    assert all(r() is None for r in plain)


def test_loading_a_bfloat16_model_frees_each_plain_weight_once_packed(embedded_artifact, monkeypatch):
    """load_model keeps no second reference (its state dict) to the weights it packs: when a linear is packed,
    every linear packed before it has been freed."""
    import gc
    import weakref

    import infer.runtime.model.packed_linear as packed
    from infer.runtime.model.loader import load_model

    if BF16 is None and AMX is None and not can_pack(torch.bfloat16):
        pytest.skip("no bfloat16 packing kernel on this CPU: nothing is packed at load")
    seen, still_alive = [], []
    real = packed.PackedLinear.__init__

    def counting(self, linear, *args, **kwargs):
        gc.collect(0)
        still_alive.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(linear.weight))
        real(self, linear, *args, **kwargs)

    monkeypatch.setattr(packed.PackedLinear, "__init__", counting)
    model = load_model(embedded_artifact, torch.bfloat16)
    assert len(seen) >= 4 * len(model.layers)  # q/k/v, o, gate/up, down each layer were packed
    assert max(still_alive) == 0, str(still_alive)
