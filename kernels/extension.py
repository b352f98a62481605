"""Builds a C++ source under kernels/csrc into a Python extension on first use, or says why not.

The build goes to torch's extension cache (about a minute per source, once per machine). A build
that failed is remembered per source digest, so not every process pays the minute again; callers
fall back to plain torch ops, and say so.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("infer.kernels")
CSRC = Path(__file__).resolve().parent / "csrc"


def build(name: str, source: str, cflags: list[str]) -> object | None:
    """The compiled module for ``csrc/<source>``, or None (with a warning) when it cannot be built."""
    if os.environ.get("INFER_DISABLE_CPP_KERNELS") == "1":
        return None
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as load_extension

    path = CSRC / source
    inputs = [path.read_bytes(), *(h.read_bytes() for h in sorted(CSRC.glob("*.h"))), " ".join(cflags).encode()]
    digest = hashlib.sha256(b"\0".join(inputs)).hexdigest()[:16]
    failed = Path(_get_build_directory(name, verbose=False)) / f"failed-{digest}"
    if failed.exists():
        log.warning("C++ kernel %s failed to build before (%s); using torch ops", name, failed)
        return None
    try:
        return load_extension(name=name, sources=[str(path)], extra_cflags=["-O3", "-march=native", *cflags],
                              extra_ldflags=[f for f in cflags if f == "-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: fall back, loudly
        failed.write_text(str(e))
        log.warning("C++ kernel %s unavailable (%s); using torch ops", name, str(e).splitlines()[0][:200])
        return None
