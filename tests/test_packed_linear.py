"""bfloat16 linears with prepacked oneDNN weights against a float64 reference, and in the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infer.runtime.packed_linear import PackedLinear, can_pack, pack_linears


def test_packing_is_available_wherever_onednn_is():
    assert can_pack(torch.bfloat16) == torch.backends.mkldnn.is_available()
    assert not can_pack(torch.float32)  # measured slower: left to F.linear


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(rows, bias):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    linear = nn.Linear(192, 80, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(torch.randn(80, 192, generator=gen) * 0.1)
    if bias:
        linear.bias.copy_(torch.randn(80, generator=gen))
    x = torch.randn(rows, 192, generator=gen).to(torch.bfloat16)
    want = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    # float32 accumulation rounded once to bfloat16: within a bf16 ulp or two of the exact result
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2)
    assert torch.allclose(got.float(), linear(x).float(), rtol=1e-2, atol=1e-2)


def test_pack_linears_swaps_the_decoder_linears_only():
    from infer.runtime.model import ModelConfig, Transformer

    cfg = ModelConfig("llama", 300, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, 128, True, False)
    torch.manual_seed(torch.seed() % 2**31)
    model = Transformer(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.2)
    ids = torch.randint(0, 300, (1, 12))
    with torch.inference_mode():
        before = model.logits(ids)
    assert pack_linears(model) == 2 * 4
    assert type(model.lm_head) is nn.Linear and type(model.layers[1].mlp.down_proj) is PackedLinear
    with torch.inference_mode():
        after = model.logits(ids)
    assert (after - before).abs().max().item() < 0.05 * before.abs().max().item()
    assert (after.argmax(-1) == before.argmax(-1)).float().mean().item() > 0.9
