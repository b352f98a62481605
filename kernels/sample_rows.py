"""The sampler's temperature draw on the CPU (kernels/csrc/sample_rows.cpp), compiled on first use.

``draw_rows(logits, inv_temperature, u)`` picks, for each row of float32 logits, the token where the running
sum of exp(inv_temperature * (logit - max)) first passes u times its total: inverse-CDF sampling without the
softmax's normalised copy or a cumulative-sum array. Where it cannot be built the sampler uses torch's softmax,
cumsum and searchsorted (runtime/engine/sampler.py), which draw from the same distribution.
"""

from __future__ import annotations

from functools import lru_cache

from .extension import build


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``draw_rows``), or None (with a warning) when it cannot be built."""
    return build("infer_sample_rows", "sample_rows.cpp", ["-fopenmp"])
