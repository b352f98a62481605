"""8-bit-weight linears in column blocks (kernels/csrc/int8_linear.cpp), on every CPU class from AVX2 up:
W8A16 (int8 per-channel weights, bfloat16 activations), W8A8 (the same weights, dynamic per-token int8
activations, exact int32 sums; vpdpbusd where the build targets AVX-512 VNNI) and FP8 (e4m3 per-channel
weights decoded in registers, dynamic per-token e4m3 activations).

A batch-1 decode step of an int8 model reads half the bytes of its bfloat16 linears; these kernels keep
the step in the column-block streaming layout bf16_linear.cpp uses (the same block widths, for the same
reason), and in the one-call C++ step (kernels/csrc/step_layers.cpp). ``load()`` gives the module only
where it can run (the active class, kernels/isa.py, is at least ``avx2`` and the source builds); elsewhere
runtime/model/quant_linear.py keeps torch's ops. ``pack_w8a16`` / ``pack_w8a8`` / ``pack_fp8`` lay a weight out
once, at load.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import isa
from .bf16_linear import block_width
from .extension import build
from .isa import cpu_flags

ACTIVATION_OFFSET = 128  # vpdpbusd multiplies unsigned activations: q + 128, less 128 x sum w per column


def vnni_flags() -> list[str]:
    """The extra target flag that builds W8A8 on vpdpbusd: the ``avx512`` class compiles for x86-64-v4,
    which leaves out VNNI even where the CPU has it (the classes above compile for the CPU itself)."""
    return ["-mavx512vnni"] if isa.active() == "avx512" and "avx512_vnni" in cpu_flags().split() else []


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``int8_linear``, ``w8a8_linear``, ``fp8_linear``), or None where it cannot run or be
    built."""
    if not isa.at_least("avx2"):
        return None
    module = build("infer_int8_linear", "int8_linear.cpp", ["-fopenmp", *vnni_flags()])
    return module if module is not None and module.available() else None


def fits_w8a8(k: int) -> bool:
    """Whether a weight of ``k`` input features has what the W8A8 kernel takes (whole groups of 4 k)."""
    return k % 4 == 0


def _blocks(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """q [N, K] int8 and scale [N] or [N, 1] -> (q padded to whole blocks [B W, K], scales [B W] float32, B, W);
    the padding columns are zero weights with scale 0."""
    n, k = q.shape
    width = block_width(n)
    blocks = -(-n // width)
    padded = torch.zeros(blocks * width, k, dtype=torch.int8)
    padded[:n] = q
    scales = torch.zeros(blocks * width, dtype=torch.float32)
    scales[:n] = scale.reshape(n).float()
    return padded, scales, blocks, width


def pack_w8a16(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N] (w = q scale) -> (packed [ceil(N/W), K, W] int8, scales [ceil(N/W) W] float32):
    per block of W output columns, row k holds the block's weights of input k."""
    padded, scales, blocks, width = _blocks(q, scale)
    k = q.shape[1]
    return padded.view(blocks, width, k).transpose(1, 2).contiguous(), scales


def pack_fp8(q: torch.Tensor, scale: torch.Tensor, pairs: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] float8_e4m3fn, scale [N] (w = q scale) -> (packed uint8 e4m3 bytes, scales [ceil(N/W) W] float32),
    in the layout the built kernel decodes (``pairs``: the module's ``fp8_pairs()`` unless given):
    - W8A16's [ceil(N/W), K, W] where bytes are widened to float32 (the padding bytes 0: e4m3 zero);
    - [ceil(N/W), K'/2, W, 2] where they are looked up as bfloat16 pairs (AVX-512 BF16 + VBMI; K' = K rounded up
      to even, the pad zero): each 64 bytes hold 32 columns' (k, k + 1) pairs in the slot order that
      kernels/csrc/int8_linear.cpp's in-lane byte interleave puts back in column order."""
    if pairs is None:
        module = load()
        pairs = module is not None and module.fp8_pairs()
    padded, scales, blocks, width = _blocks(q.view(torch.int8), scale)
    if not pairs:
        k = q.shape[1]
        return padded.view(blocks, width, k).transpose(1, 2).contiguous().view(torch.uint8), scales
    k = q.shape[1] + q.shape[1] % 2
    padded = torch.nn.functional.pad(padded, (0, k - q.shape[1]))
    packed = padded.view(blocks, width // 32, 32, k // 2, 2)[:, :, _FP8_PAIR_SLOTS]  # slot s holds its column
    return packed.permute(0, 3, 1, 2, 4).reshape(blocks, k // 2, width, 2).contiguous().view(torch.uint8), scales


# the column of 32 that each pair slot of a 64-byte chunk holds: slot 8 l + i is column 4 l + i (i < 4) or
# 16 + 4 l + i - 4 (i >= 4)
_FP8_PAIR_SLOTS = torch.tensor([4 * (s // 8) + s % 8 if s % 8 < 4 else 16 + 4 * (s // 8) + s % 8 - 4 for s in range(32)])


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] int8 (K a multiple of 4), scale [N] -> (packed [ceil(N/W), K/4, W, 4] int8, scales
    [ceil(N/W) W] float32, colsums [ceil(N/W) W] int32 = 128 x sum_k q): each 32-bit word one column's 4
    consecutive k."""
    n, k = q.shape
    if not fits_w8a8(k):
        raise ValueError(f"w8a8_linear: a [{n}, {k}] weight does not fit the kernel (K must be a multiple of 4)")
    padded, scales, blocks, width = _blocks(q, scale)
    packed = padded.view(blocks, width, k // 4, 4).transpose(1, 2).contiguous()
    colsums = (padded.to(torch.int32).sum(1) * ACTIVATION_OFFSET).to(torch.int32)
    return packed, scales, colsums
