"""The CPU paged-attention kernel (kernels/csrc/paged_attention.cpp), compiled on first use.

torch's CPU SDPA is slow for decode (a handful of queries against hundreds of keys) and needs
the context gathered out of the block pool first; this kernel reads K/V in place. It is built
with the machine's C++ compiler into torch's extension cache (once, about a minute); where no
compiler is available the engine falls back to gather + SDPA, and says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("infer.kernels")
SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled extension module, or None (with a warning) when it cannot be built."""
    if os.environ.get("INFER_DISABLE_CPP_KERNELS") == "1":
        return None
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as load_extension

    # a build that failed once for this source is not retried by every process (each try costs a minute)
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    failed = Path(_get_build_directory("infer_paged_attention", verbose=False)) / f"failed-{digest}"
    if failed.exists():
        log.warning("CPU paged-attention kernel failed to build before (%s); using gather + SDPA", failed)
        return None
    try:
        return load_extension(
            name="infer_paged_attention",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: fall back, loudly
        failed.write_text(str(e))
        log.warning("CPU paged-attention kernel unavailable (%s); using gather + SDPA", str(e).splitlines()[0][:200])
        return None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [seqs, heads, d]; caches [blocks, block_size, kv_heads, d]; returns [seqs, heads, d]."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    return module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
