"""The sampler's filters and draw on the CPU (kernels/csrc/sample_rows.cpp), compiled on first use.

``draw_rows(logits, inv_temperature, u, top_k, top_p, min_p)`` picks, for each row of float32 logits, the token
where the running sum of the weights exp(inv_temperature * (logit - max)) that top-k, top-p and min-p keep first
passes u times their total: inverse-CDF sampling with each filter a threshold on the weights (a radix select,
no sort), no normalised copy and no cumulative-sum array. Where it cannot be built the sampler uses torch's sort,
softmax, cumsum and searchsorted (runtime/engine/sampler.py), which draw from the same distribution.
"""

from __future__ import annotations

from functools import lru_cache

from .extension import build


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``draw_rows``), or None (with a warning) when it cannot be built."""
    return build("infer_sample_rows", "sample_rows.cpp", ["-fopenmp"])
