"""The fused RMSNorm / rotary / SiLU-and-multiply kernels against the model's own torch ops, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import layer_ops
from infer.runtime.model.llama import RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops():
    module = layer_ops.load()
    assert module is not None  # these machines have a compiler: a missing kernel is a failure
    return module


def pair(cls, *args, ops):
    torch_version, fused = cls(*args), cls(*args)
    fused.ops = ops
    return torch_version, fused


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the last bit of the dtype (the float32 sum of squares may add up in another order)."""
    eps = torch.finfo(got.dtype).eps
    assert torch.allclose(got.float(), want.float(), rtol=2 * eps, atol=1e-6)
    if got.dtype != torch.float32:  # rounding to 16 bits hides the float32 difference almost always
        assert (got == want).float().mean().item() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_torch(ops, dtype, rows):
    hidden = 96
    ref, fused = pair(RMSNorm, hidden, 1e-5, ops=ops)
    ref.weight.data = fused.weight.data = torch.rand(hidden) + 0.5
    ref, fused = ref.to(dtype).requires_grad_(False), fused.to(dtype).requires_grad_(False)
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    got, stream = fused(x)
    want, _ = ref(x)
    close(got, want)
    assert stream is x


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(ops, dtype):
    hidden, rows = 160, 33
    ref, fused = pair(RMSNorm, hidden, 1e-6, ops=ops)
    ref.weight.data = fused.weight.data = torch.rand(hidden) + 0.5
    ref, fused = ref.to(dtype).requires_grad_(False), fused.to(dtype).requires_grad_(False)
    x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    want, want_stream = ref(x, residual)
    got, got_stream = fused(x.clone(), residual.clone())
    assert torch.equal(got_stream, want_stream)  # the residual add rounds exactly as torch's
    close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64])  # 16 pairs a vector: one, one and a scalar tail, two
def test_rotary_in_place_matches_torch(ops, dtype, head_dim):
    heads, kv_heads, rows = 6, 2, 21
    ref, fused = pair(RotaryEmbedding, head_dim, 10000.0, 512, ops=ops)
    # a fused qkv row: q and k heads rotate, v (the tail) must stay untouched
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 512, (rows,))
    want, got = qkv.clone(), qkv.clone()
    ref.rotate_(want, heads + kv_heads, head_dim, ref.tables(positions, dtype))
    fused.rotate_(got, heads + kv_heads, head_dim, fused.tables(positions, dtype))
    assert torch.equal(got, want)  # the same products and sums, rounded at the same places
    assert torch.equal(got[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])
    assert not torch.equal(got, qkv)


def test_rotary_refuses_a_position_past_the_table(ops):
    rot = RotaryEmbedding(16, 10000.0, 8)
    with pytest.raises(RuntimeError, match="position 8 outside the table of 8"):
        ops.rotary_(torch.zeros(2, 32), torch.tensor([3, 8]), rot.cos, rot.sin, 2, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 40), (300, 96)])
def test_silu_mul_matches_torch(ops, dtype, rows, inter):
    from infer.runtime.model.llama import MLP, ModelConfig

    cfg = ModelConfig("llama", 64, 32, inter, 1, 2, 2, 16, 1e-5, 10000.0, 64, False, False)
    ref, fused = pair(MLP, cfg, ops=ops)
    fused.load_state_dict(ref.state_dict())
    ref, fused = ref.to(dtype).requires_grad_(False), fused.to(dtype).requires_grad_(False)
    # a wide range of gate values: exp(-g) under- and overflows at the ends (SiLU -> g and -0)
    gate_up = torch.cat([torch.randn(rows, inter) * 8, torch.randn(rows, inter)], dim=1)
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 200.0])
    gate_up = gate_up.to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = ops.silu_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
    close(got, want)
    # through the module: one fused pass where the torch MLP splits, activates and multiplies
    x = torch.randn(rows, 32).to(dtype)
    assert torch.allclose(fused(x).float(), ref(x).float(), rtol=4 * torch.finfo(dtype).eps, atol=1e-5)
    # rows of a strided view (the fused projection's output as a slice of something wider)
    wide = torch.cat([gate_up, gate_up[:, :8]], dim=1)[:, :2 * inter]
    assert torch.equal(ops.silu_mul(wide), got)
