"""Builds a C++ source under kernels/csrc into a Python extension on first use, or says why not.

The build goes to torch's extension cache (about a minute per source, once per machine). A build
that failed to compile is remembered per source digest, so not every process pays the minute again;
a failure of the machine (a full disk, a permission) is not remembered, so the next process retries.
Callers fall back to plain torch ops, and say so.
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
        log.warning("C++ kernel %s failed to build before (%s); using torch ops; delete that file to retry",
                    name, failed)
        return None
    try:
        # the digest as a define: torch rebuilds when build flags change, but hashes no headers itself
        return load_extension(name=name, sources=[str(path)],
                              extra_cflags=["-O3", "-march=native", f"-DINFER_SOURCE_DIGEST={digest}", *cflags],
                              extra_ldflags=[f for f in cflags if f == "-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: fall back, loudly
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        if not (isinstance(e, OSError) or "No space left on device" in str(e)):
            try:
                failed.write_text(str(e) or type(e).__name__)
            except OSError:
                pass  # cannot even write the marker: the next process simply tries again
        log.warning("C++ kernel %s unavailable (%s); using torch ops", name, reason)
        return None


AMX_FLAGS = ["-fopenmp", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bf16"]


def build_amx(name: str, source: str) -> object | None:
    """An AMX kernel's module, only where it can run: a CPU with AMX, a source that builds, and a
    kernel that grants this process tile permission (the module's ``enable_amx``); else None."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    module = build(name, source, AMX_FLAGS)
    if module is None or not module.enable_amx():
        return None
    return module
