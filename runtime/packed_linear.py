"""bfloat16 linears whose weights are reordered once, at load, into oneDNN's blocked layout.

``F.linear`` hands oneDNN a row-major weight, which its AMX / AVX-512 matmul kernels copy into
their blocked layout on every call; for a small model that copy is a good share of each step.
Reordering once (as torch.compile's CPU freezing does) removes it. Measured on the embedded model
in bfloat16, one thread, through the engine: a 30-token prefill after a cached prefix 86 -> 73 ms,
a 430-token prefill 420 -> 320 ms, a batch-64 decode step 135 -> 117 ms. float32 gains nothing
(tried: slower at 1 and 432 tokens), so only bfloat16 is packed. Same maths; oneDNN may block the
reduction differently, so results agree to bfloat16 rounding rather than bit for bit.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed_weight, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)


@lru_cache(maxsize=None)
def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU pack ``dtype`` weights (bfloat16, with oneDNN and bf16 instructions)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        linear = nn.Linear(32, 16, bias=False, dtype=dtype).requires_grad_(False)
        x = torch.randn(3, 32, dtype=dtype)
        return torch.allclose(PackedLinear(linear)(x).float(), linear(x).float(), atol=1e-2)
    except (RuntimeError, AttributeError):  # a build without these mkldnn ops, a CPU without bf16
        return False


def pack_linears(model: nn.Module) -> int:
    """Swaps every plain ``nn.Linear`` in the decoder layers for a PackedLinear; returns how many.

    The LM head stays as it is: it often shares its weight with the embedding, which lookups need
    in plain layout."""
    count = 0
    for layer in model.layers:
        for name, module in list(layer.named_modules()):
            if type(module) is nn.Linear:
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr, PackedLinear(module))
                count += 1
    return count
