"""bfloat16 linears with prepacked weights (AMX tiles, oneDNN) against a float64 reference, and in the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infer.kernels import amx_linear
from infer.kernels.onednn import can_pack
from infer.runtime.model.packed_linear import PackedLinear, pack_linears

AMX = amx_linear.load()


def test_packing_is_available_wherever_onednn_is():
    assert can_pack(torch.bfloat16) == torch.backends.mkldnn.is_available()
    assert not can_pack(torch.float32)  # measured slower: left to F.linear


def test_amx_kernel_is_used_wherever_the_cpu_has_amx():
    # a CPU with AMX and a compiler: a missing kernel is a failure, not a fallback to accept
    assert (AMX is not None) == torch.cpu._is_amx_tile_supported()


def _kernels():
    return ["onednn", pytest.param("amx", marks=pytest.mark.skipif(AMX is None, reason="this CPU has no AMX: the AMX kernel cannot run here; the onednn case ran"))]


def _random_linear(n: int, k: int, bias: bool, gen) -> nn.Linear:
    linear = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
    if bias:
        linear.bias.copy_(torch.randn(n, generator=gen))
    return linear


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(kernel, rows, bias):
    gen = torch.Generator().manual_seed(torch.initial_seed())
    # 1536 inputs: 300 rows span two of the AMX kernel's row blocks
    linear = _random_linear(96, 1536 if rows == 300 else 192, bias, gen)
    packed = PackedLinear(linear, AMX if kernel == "amx" else None)
    assert (packed.amx is not None) == (kernel == "amx")
    x = torch.randn(rows, linear.in_features, generator=gen).to(torch.bfloat16)
    want = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # float32 accumulation rounded once to bfloat16: within a bf16 ulp or two of the exact result
    scale = want.abs().max().item()
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2 * scale)
    assert torch.allclose(got.float(), linear(x).float(), rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.skipif(AMX is None, reason="this CPU has no AMX: the AMX kernel cannot run here")
def test_amx_linear_takes_strided_rows_and_falls_back_on_shapes_it_cannot_tile():
    gen = torch.Generator().manual_seed(torch.initial_seed())
    linear = _random_linear(64, 96, True, gen)
    wide = torch.randn(5, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, 3:99]  # rows 200 apart, as a slice of a fused projection's output is
    want = x.double() @ linear.weight.double().t() + linear.bias.double()
    got = PackedLinear(linear, AMX)(x)
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    # 80 outputs are not a multiple of 32: that layer stays on oneDNN, with the same results
    odd = PackedLinear(_random_linear(80, 96, False, gen), AMX)
    assert odd.amx is None and "kernel=onednn" in repr(odd)


@pytest.mark.parametrize("kernel", _kernels())
def test_pack_linears_swaps_the_decoder_linears_and_with_amx_the_lm_head(kernel):
    from infer.runtime.model import ModelConfig, Transformer

    amx = AMX if kernel == "amx" else None
    cfg = ModelConfig("llama", 320, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, 128, True, False)
    model = Transformer(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.2)
    model.lm_head.weight = model.embed_tokens.weight  # tied, as in the embedded model
    ids = torch.randint(0, 320, (1, 12))
    with torch.inference_mode():
        before = model.logits(ids)
    assert pack_linears(model, amx) == 2 * 4 + (amx is not None)
    assert type(model.layers[1].mlp.down_proj) is PackedLinear
    assert type(model.lm_head) is (PackedLinear if amx is not None else nn.Linear)
    assert model.embed_tokens.weight.shape == (320, 64)  # lookups keep the plain embedding
    with torch.inference_mode():
        after = model.logits(ids)
    assert (after - before).abs().max().item() < 0.05 * before.abs().max().item()
    assert (after.argmax(-1) == before.argmax(-1)).float().mean().item() > 0.9
