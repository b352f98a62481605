"""bfloat16 linears whose weights are reordered once, at load, into a matmul kernel's own layout.

``F.linear`` hands oneDNN a row-major weight, which its matmul kernels copy into their blocked
layout on every call; for a small model that copy is a good share of each step. Two layouts
instead, chosen per layer at load:

- AMX tiles (kernels/amx_linear.py), on CPUs with AMX: a kernel that streams the weights at close
  to memory speed, which is what matters for a decode step or a short prompt chunk (a few rows
  times every weight). Measured on the embedded model's layers at two threads: 1 row 11 vs 25 ms
  (oneDNN), 30 rows 15-19 vs 24-38 ms, 430 rows 155-200 vs 215-270 ms; the 57 MB LM head for one
  row 1.7 vs 5-6 ms. Used for the LM head too (a copy, when it shares the embedding's weight).
- oneDNN's blocked layout elsewhere (as torch.compile's CPU freezing does): a 30-token prefill
  after a cached prefix 86 -> 73 ms, a 430-token prefill 420 -> 320 ms, a batch-64 decode step
  135 -> 117 ms, one thread. float32 gains nothing (tried), so only bfloat16 is packed.

Same maths (float32 accumulation, one rounding to bfloat16); the reduction may be blocked
differently, so results agree to bfloat16 rounding rather than bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from infer.kernels import amx_linear, onednn


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, amx=None):
        """``amx``: kernels.amx_linear's module, used when the weight's shape fits it; else oneDNN."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.amx = amx if amx is not None and amx_linear.fits(weight) else None
        if self.amx is not None:
            self.packed_weight = amx_linear.pack(weight)
        else:
            self.packed_weight = onednn.pack(weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.amx is not None:
            y = self.amx.amx_linear(x, self.packed_weight, self.bias)
        else:
            y = onednn.linear(x, self.packed_weight, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "amx" if self.amx is not None else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={kernel}"


def pack_linears(model: nn.Module, amx=None, onednn_ok: bool = True, choose=None) -> int:
    """Swaps the model's plain bfloat16 ``nn.Linear``s for PackedLinears; returns how many.

    ``amx``: kernels.amx_linear's module (the kernel resolver's choice), or None for oneDNN's layout
    (where ``onednn_ok``). By default decoder linears take AMX where the shape fits, else oneDNN;
    the LM head takes AMX where it fits (a copy: the embedding keeps its plain weight for lookups)
    and stays plain otherwise, since oneDNN's layout gains nothing there. ``choose(in, out)``: a
    tuning table's kernel for a shape (amx | onednn | torch), used where this machine can run it."""
    def kernel_for(linear: nn.Linear, default: str) -> str:
        wanted = choose(linear.in_features, linear.out_features) if choose else None
        can = {"amx": amx is not None and amx_linear.fits(linear.weight), "onednn": onednn_ok, "torch": True}
        return wanted if wanted and can.get(wanted) else default

    def packed(linear: nn.Linear, default: str) -> nn.Module:
        kernel = kernel_for(linear, default)
        return linear if kernel == "torch" else PackedLinear(linear, amx if kernel == "amx" else None)

    count = 0
    fits = lambda m: amx is not None and amx_linear.fits(m.weight)  # noqa: E731
    for layer in model.layers:
        for name, module in list(layer.named_modules()):
            if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
                new = packed(module, "amx" if fits(module) else "onednn" if onednn_ok else "torch")
                if new is not module:
                    parent, _, attr = name.rpartition(".")
                    setattr(layer.get_submodule(parent) if parent else layer, attr, new)
                    count += 1
    head = model.lm_head
    if type(head) is nn.Linear and head.weight.dtype == torch.bfloat16:
        model.lm_head = packed(head, "amx" if fits(head) else "torch")
        count += model.lm_head is not head
    return count
