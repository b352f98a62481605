"""bfloat16 linears whose weights are reordered once, at load, into a matmul kernel's own layout.

``F.linear`` hands oneDNN a row-major weight, which its matmul kernels copy into their blocked
layout on every call; for a small model that copy is a good share of each step. Two layouts
instead, chosen per layer at load:

- AMX tiles (kernels/amx_linear.py), on CPUs with AMX: a kernel that streams the weights at close
  to memory speed, which is what matters for a decode step or a short prompt chunk (a few rows
  times every weight). Measured on the embedded model's layers at two threads: 1 row 11 vs 25 ms
  (oneDNN), 30 rows 15-19 vs 24-38 ms, 430 rows 155-200 vs 215-270 ms; the 57 MB LM head for one
  row 1.7 vs 5-6 ms. Used for the LM head too (a copy, when it shares the embedding's weight).
- column blocks (``blocks``, kernels/bf16_linear.py), on every CPU with AVX2 + FMA and no AMX in use
  (vdpbf16ps with AVX-512 BF16, else bfloat16 widened to float32 in registers): the same idea, one
  sequential stream per 64 output columns (32 for narrow weights); on a Zen 4 host, every linear of the
  embedded model once (a decode step's weights) 10 vs 20 ms at 1 row, and ahead of oneDNN up to 256
  rows. The LM head too, as with AMX.
- oneDNN's blocked layout elsewhere (as torch.compile's CPU freezing does): a 30-token prefill
  after a cached prefix 86 -> 73 ms, a 430-token prefill 420 -> 320 ms, a batch-64 decode step
  135 -> 117 ms, one thread. float32 gains nothing (tried), so only bfloat16 is packed.

Same maths (float32 accumulation, one rounding to bfloat16); the reduction may be blocked
differently, so results agree to bfloat16 rounding rather than bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from infer.kernels import amx_linear, bf16_linear, hugepages, onednn

KERNELS = ("amx", "blocks", "onednn")  # the packed layouts; "torch" is the plain nn.Linear


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel: str = "onednn", module=None, storage: torch.Tensor | None = None):
        """``kernel``: amx | blocks (``module``: that kernel's compiled module, which must fit the
        weight's shape) | onednn. ``storage``: uint8 memory of ``packed_nbytes`` for an amx or
        blocks weight (a slice of pack_linears' huge-page arena), else its own tensor."""
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"PackedLinear: kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernel, self.module = kernel, module
        if kernel == "amx":
            assert module is not None and amx_linear.fits(weight), "amx: needs the module and a shape it tiles"
            self.packed_weight = _into(amx_linear.pack(weight), storage)
            self.bias = linear.bias
        elif kernel == "blocks":
            assert module is not None and bf16_linear.fits(weight), "blocks: needs the module and an even K"
            # written straight into its arena slot (whole cache lines, so it views as the weight's dtype)
            self.packed_weight = bf16_linear.pack(weight, None if storage is None else storage.view(weight.dtype))
            # added in float32 before the one rounding, as oneDNN does
            self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        else:
            self.packed_weight = onednn.pack(weight)
            self.bias = linear.bias

    @property
    def kernel_name(self) -> str:  # the plan's name for it (runtime/engine/plan.py)
        return f"bfloat16 {self.kernel}"

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x @ W^T + b, rounded to bfloat16; ``float_out``: the float32 sums unrounded (the LM head's logits),
        where the kernel keeps them (amx, blocks), else the rounded output widened."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.kernel == "blocks":
            y = self.module.bf16_linear(x if x.stride(-1) == 1 else x.contiguous(), self.packed_weight,
                                        self.out_features, self.bias, float_out)
        elif self.kernel == "amx":
            y = self.module.amx_linear(x, self.packed_weight, self.bias, float_out)
        else:
            y = onednn.linear(x, self.packed_weight, self.bias)
            y = y.float() if float_out else y
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def packed_nbytes(weight: torch.Tensor, kernel: str) -> int:
    """Bytes of ``weight`` in ``kernel``'s layout (amx | blocks), rounded up to a cache line."""
    if kernel == "amx":
        nbytes = weight.numel() * weight.element_size()
    else:
        n, k = weight.shape
        nbytes = bf16_linear.padded_rows(n) * k * weight.element_size()
    return -(-nbytes // 64) * 64


def _into(packed: torch.Tensor, storage: torch.Tensor | None) -> torch.Tensor:
    if storage is None:
        return packed
    out = storage[:packed.numel() * packed.element_size()].view(packed.dtype).view(packed.shape)
    return out.copy_(packed)


def pack_linears(model: nn.Module, amx=None, onednn_ok: bool = True, choose=None, bf16=None) -> int:
    """Swaps the model's plain bfloat16 ``nn.Linear``s for PackedLinears; returns how many.

    ``amx``, ``bf16``: kernels.amx_linear's and kernels.bf16_linear's modules (the kernel resolver's
    choice), or None; oneDNN's layout where ``onednn_ok``. By default each decoder linear takes the
    first of AMX, column blocks and oneDNN that fits its shape; the LM head takes AMX or blocks
    where one fits (a copy: the embedding keeps its plain weight for lookups) and stays plain
    otherwise, since oneDNN's layout gains nothing there. ``choose(in, out, runnable)``: a tuning
    table's kernel for a shape (amx | blocks | onednn | torch) given the kernels this machine can
    run for it, used where it is one of them. The AMX and column-block weights, which a decode step
    streams, share one arena on huge pages (kernels/hugepages.py), in the order a step reads them."""
    def can(linear: nn.Linear) -> dict:
        return {"amx": amx is not None and amx_linear.fits(linear.weight),
                "blocks": bf16 is not None and bf16_linear.fits(linear.weight), "onednn": onednn_ok,
                "torch": True}

    def kernel_for(linear: nn.Linear, order: tuple[str, ...]) -> str:
        runs = can(linear)
        wanted = choose(linear.in_features, linear.out_features, {k for k, ok in runs.items() if ok}) if choose else None
        return wanted if wanted and runs.get(wanted) else next(k for k in order if runs[k])

    # (parent module, attribute, linear, kernel) of every linear to pack, decoders first
    plan = []
    for layer in model.layers:
        for name, module in list(layer.named_modules()):
            if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
                parent, _, attr = name.rpartition(".")
                plan.append((layer.get_submodule(parent) if parent else layer, attr, module,
                             kernel_for(module, ("amx", "blocks", "onednn", "torch"))))
    head = model.lm_head
    if type(head) is nn.Linear and head.weight.dtype == torch.bfloat16:
        plan.append((model, "lm_head", head, kernel_for(head, ("amx", "blocks", "torch"))))
    # the streaming kernels' weights in one huge-page arena, in the order a step reads them
    streamed = [(lin, k) for _, _, lin, k in plan if k in ("amx", "blocks")]
    sizes = [packed_nbytes(lin.weight, k) for lin, k in streamed]
    memory = hugepages.arena(sum(sizes)) if streamed else None
    slots, offset = {}, 0
    for (lin, _), size in zip(streamed, sizes):
        slots[id(lin)] = memory[offset:offset + size]
        offset += size
    streamed = module = head = None  # the plan holds the linears now, and lets each go once packed
    count = 0
    plan.reverse()
    while plan:  # each plain weight let go once packed: a model's size, not twice it, while loading
        parent, attr, linear, kernel = plan.pop()
        if kernel != "torch":
            setattr(parent, attr, PackedLinear(linear, kernel, {"amx": amx, "blocks": bf16}.get(kernel),
                                               slots.pop(id(linear), None)))
            count += 1
        del linear
    return count
