"""Fused RMSNorm (+ residual add), in-place rotary embedding and SiLU-and-multiply (kernels/csrc/layer_ops.cpp).

The model uses these when they build and its own torch ops otherwise; both compute the same
values (the kernel rounds where torch rounds; SiLU may differ in a last bit, rarely), so the choice
changes speed, not outputs.
"""

from __future__ import annotations

from functools import lru_cache

from .extension import build


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``rms_norm``, ``add_rms_norm_``, ``rotary_``, ``silu_mul``), or None when it cannot be built."""
    # exact IEEE arithmetic: no -ffast-math, no fused multiply-add contraction
    return build("infer_layer_ops", "layer_ops.cpp", ["-fopenmp", "-ffp-contract=off"])
