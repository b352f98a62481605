"""Builds a C++ source under kernels/csrc into a Python extension, once per machine and environment.

``python -m infer.kernels build`` (run by ``make install``) compiles every kernel ahead of time, so
no user request waits for a compiler; a process that finds one missing builds it at load (about a
minute a source) and says so. Builds are cached under ``$INFER_KERNEL_CACHE`` (default
``~/.cache/infer/kernels``) in a directory keyed by what decides the binary: the source and its
headers, the compiler flags (the CPU class's target, kernels/isa.py), the torch version and where it
is installed (the build file names its headers' path: two environments with one version would rebuild
over each other), and the CPU's instruction-set flags. Two environments, or two machines sharing a home
directory, never load each other's builds or rebuild over them; two checkouts in one environment share
them (each build compiles its own copy of its sources).

A build that failed to compile is remembered by its key, so not every process pays the minute
again; a failure of the machine (a full disk, a permission) is not remembered, so the next process
retries. Callers fall back to plain torch ops, and say so (the kernel resolver decides). A process killed
while compiling leaves torch's build lock (``lock`` in the build directory), on which every later load
would wait forever: a lock older than any compile takes (STALE_LOCK_S) is removed, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import time
from pathlib import Path

from . import isa
from .isa import cpu_flags

log = logging.getLogger("infer.kernels")
CSRC = Path(__file__).resolve().parent / "csrc"
BASE_FLAGS = ["-O3"]  # and the class's target flags (isa.compile_flags)
STALE_LOCK_S = 600  # a kernel compiles in about a minute (step_layers.cpp, the largest, ~2 on 2 cores)


def cache_root() -> Path:
    return Path(os.environ.get("INFER_KERNEL_CACHE") or Path.home() / ".cache" / "infer" / "kernels")


def cpu_has_amx() -> bool:
    """Whether the kernels run on AMX tiles: the CPU has them, the OS grants them, and no lower class
    is forced (kernels/isa.py)."""
    return isa.active() == "amx"


def cpu_has_avx512_bf16() -> bool:
    """Whether the active class has AVX-512 BF16 (vdpbf16ps), which the tuning table records."""
    return isa.at_least("avx512bf16")


def flags() -> list[str]:
    """Every kernel's compiler flags before its own: optimisation and the active class's target."""
    return [*BASE_FLAGS, *isa.compile_flags()]


def sources(source: str) -> dict[str, bytes]:
    """What a build compiles, by file name, read once: the source, the sources it includes, and every header."""
    text = (CSRC / source).read_bytes()
    included = sorted(set(re.findall(rb'#include "([\w.]+\.cpp)"', text)))
    return {source: text, **{c.decode(): (CSRC / c.decode()).read_bytes() for c in included},
            **{h.name: h.read_bytes() for h in sorted(CSRC.glob("*.h"))}}


def build_key(source: str, cflags: list[str], files: dict[str, bytes] | None = None) -> str:
    """The identity of a build: source (and sources it includes) and headers (``files``, read here when not
    given), flags, torch version and install directory, CPU instruction set."""
    import torch

    inputs = [*(files or sources(source)).values(),
              " ".join(flags() + cflags).encode(), torch.__version__.encode(),
              str(Path(torch.__file__).resolve().parent).encode(), cpu_flags().encode(),
              platform.python_version().encode()]
    return hashlib.sha256(b"\0".join(inputs)).hexdigest()[:16]


def _copy_sources(files: dict[str, bytes], into: Path) -> None:
    """The build's own copy of its sources (written where it differs): ninja's build file names the source's
    path, so compiling from the checkout would rebuild a cached kernel whenever another checkout (a git
    worktree, a second clone) with the same sources loaded it."""
    into.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        copy = into / name
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)


def build(name: str, source: str, cflags: list[str]) -> object | None:
    """The compiled module for ``csrc/<source>``, or None (with a warning) when it cannot be built."""
    if os.environ.get("INFER_DISABLE_CPP_KERNELS") == "1":
        return None
    from torch.utils.cpp_extension import load as load_extension

    files = sources(source)
    key = build_key(source, cflags, files)
    directory = cache_root() / f"{name}-{key}"
    failed = directory / "failed"
    if failed.exists():
        log.warning("C++ kernel %s failed to build before (%s); using torch ops; delete that file to retry",
                    name, failed)
        return None
    lock = directory / "lock"  # torch.utils.cpp_extension's FileBaton
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        age = 0.0
    if age > STALE_LOCK_S:
        log.warning("removing %s: a build lock %.0f s old, left by a process killed while compiling %s", lock, age,
                    name)
        lock.unlink(missing_ok=True)
    fresh = not any(directory.glob("*.so"))
    if fresh:
        log.warning("compiling the C++ kernel %s (about a minute, once; `python -m infer.kernels build` does it "
                    "ahead of time)", name)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # the key in the module's name and as a define: the module records which build it is, and torch's
        # loader, which renames (and so recompiles) a name it already loaded with other flags in this
        # process, sees each build under a name of its own (a test loading two classes compiles neither)
        _copy_sources(files, directory / "src")
        return load_extension(name=f"{name}_{key}", sources=[str(directory / "src" / source)],
                              build_directory=str(directory),
                              extra_cflags=[*flags(), f"-DINFER_SOURCE_DIGEST={key}", *cflags],
                              extra_ldflags=[f for f in cflags if f == "-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: fall back, loudly
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        # not remembered: the machine's faults, and a module missing after a wait on another process's lock
        # (that process died before linking it: the next load builds it)
        if not (isinstance(e, OSError) or "No space left on device" in str(e)
                or "cannot open shared object file" in str(e)):
            try:
                failed.write_text(str(e) or type(e).__name__)
            except OSError:
                pass  # cannot even write the marker: the next process simply tries again
        log.warning("C++ kernel %s unavailable (%s); using torch ops", name, reason)
        return None


AMX_ISA = ["-mamx-tile", "-mamx-bf16"]  # also what step_layers.cpp adds to build its AMX parts
AMX_FLAGS = ["-fopenmp", *AMX_ISA, "-mavx512f", "-mavx512bf16"]


def build_amx(name: str, source: str) -> object | None:
    """An AMX kernel's module, only where it can run: a CPU with AMX, a source that builds, and a
    kernel that grants this process tile permission (the module's ``enable_amx``); else None."""
    if not cpu_has_amx():
        return None
    module = build(name, source, AMX_FLAGS)
    if module is None or not module.enable_amx():
        return None
    return module
