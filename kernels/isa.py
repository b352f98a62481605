"""The CPU class the kernels are built for and run on: one place that says which it is.

Classes, lowest first: ``avx2`` (AVX2 + FMA: AMD Zen 2/3, older Intel), ``avx512`` (AVX-512F/BW/VL,
VNNI where present, no BF16: Intel Ice Lake, Cascade Lake, or a hypervisor hiding BF16),
``avx512bf16`` (AMD Zen 4/5, Intel Cooper Lake), ``amx`` (Intel Sapphire Rapids and later). The
class is the highest the CPU has, unless ``INFER_ISA`` names a lower one: then every kernel is
compiled for that class alone (its own ``-march`` target, so an ``avx2`` build holds no AVX-512
instruction) and every choice made from the CPU's features is made as on such a CPU. That is how
one host tests and benchmarks every class it can execute. ``INFER_AMX=0`` is ``INFER_ISA`` capped
at ``avx512bf16``. Asking for a class above the CPU's is an error naming what the CPU has.

Setting ``INFER_ISA`` also holds torch's own kernels to the class (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``) when they are not set already: torch reads them once, at its first kernel,
so a process should set ``INFER_ISA`` before it starts.

Why target flags rather than a dispatch library: each kernel source is compiled once per class by
the build step that already exists (kernels/extension.py, keyed by its flags), and the code chooses
its instructions with ``#if defined(__AVX512BF16__)`` / ``__AVX512F__`` / ``__AVX2__``: one source per
operation, no hand-copied file per class, and no new dependency. Google Highway would add run-time
dispatch inside one binary, which a per-class build makes unnecessary; ATen's ``Vectorized`` has no
widening of the packed pair layout the linears use.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

CLASSES = ("avx2", "avx512", "avx512bf16", "amx")
# each class's compiler target; native for the top ones, which are what the CPU is
_MARCH = {"avx2": ["-march=x86-64-v3"], "avx512": ["-march=x86-64-v4"]}
_MNO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
_TORCH_CAPABILITY = {"avx2": ("AVX2", "AVX2"), "avx512": ("AVX512", "AVX512_CORE_VNNI"),
                     "avx512bf16": ("AVX512", "AVX512_CORE_BF16")}


def _cpuinfo(*keys: str) -> str | None:
    """The value of /proc/cpuinfo's first line that starts with one of ``keys`` (None: no such line or file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """The CPU's instruction-set flags, sorted (what ``-march=native`` compiles for)."""
    flags = _cpuinfo("flags", "Features")
    if flags is None:
        return platform.processor() or platform.machine()
    return " ".join(sorted(set(flags.split())))


@lru_cache(maxsize=1)
def native_class() -> str | None:
    """The highest class this CPU has (None: below AVX2 + FMA, where only torch's ops run)."""
    flags = set(cpu_flags().split())
    if not {"avx2", "fma"} <= flags:
        return None
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx2"
    if "avx512_bf16" not in flags:
        return "avx512"
    if {"amx_tile", "amx_bf16"} <= flags:
        import torch  # the OS must also grant the tiles, which torch asks

        if torch.cpu._is_amx_tile_supported():
            return "amx"
    return "avx512bf16"


def _rank(name: str | None) -> int:
    return -1 if name is None else CLASSES.index(name)


def active() -> str | None:
    """The class the kernels are built for and chosen by: the CPU's, or lower as ``INFER_ISA`` /
    ``INFER_AMX=0`` say."""
    native = native_class()
    want = os.environ.get("INFER_ISA", "").strip().lower() or None
    if want is not None and want not in CLASSES:
        raise ValueError(f"INFER_ISA={want!r}: choose one of {', '.join(CLASSES)} (or leave it unset for the "
                         f"CPU's own, {native})")
    if want is not None and _rank(want) > _rank(native):
        raise ValueError(f"INFER_ISA={want} but this CPU's highest class is {native} (flags: see /proc/cpuinfo); "
                         f"choose {native} or lower")
    chosen = want or native
    if os.environ.get("INFER_AMX", "1") == "0" and chosen == "amx":
        chosen = "avx512bf16"
    return chosen


def at_least(name: str) -> bool:
    """Whether the active class includes ``name``'s instructions."""
    return _rank(active()) >= _rank(name)


def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's int8 GEMM (``torch._int_mm`` on the CPU) sums exactly in this process. With VNNI
    (``vpdpbusd``) it does; without, it multiplies offset u8 activations by s8 weights with ``vpmaddubsw``,
    whose int16 pair sums saturate: on a Zen 5, ``ONEDNN_MAX_CPU_ISA=AVX2`` or ``AVX512_CORE`` gave wrong
    sums for rows of large codes, ``AVX512_CORE_VNNI`` exact ones."""
    flags = set(cpu_flags().split())
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ("SSE41", "AVX", "AVX2", "AVX512_CORE")
    vnni = ("avx512_vnni" in flags and at_least("avx512")) or ("avx_vnni" in flags and active() == native_class())
    return vnni and not held


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (``GenuineIntel``, ``AuthenticAMD``), or ''."""
    return _cpuinfo("vendor_id") or ""


def prefetch_bytes() -> int:
    """How far ahead of its loads a plain linear kernel (bfloat16, W8A8: kernels/csrc/prefetch.h) prefetches the
    weights it streams (0: no prefetch instruction), by CPU vendor unless ``INFER_PREFETCH_BYTES`` sets it.
    The kernels that decode each weight first (int4, W8A16, FP8) prefetch 2 KiB ahead everywhere.

    Intel: 2 KiB. On a 2-core Xeon with AMX, a batch-1 sweep of the embedded model's 121 bfloat16 linears
    read 0.70 of a ``sum``'s bandwidth with the hardware prefetchers alone, 0.83 / 0.86 / 0.91 / 0.86 at
    512 B / 1 / 2 / 4 KiB ahead; its 120 int4 ones 0.63 alone, 0.77 at 2 KiB.
    AMD: none. On a 2-core Zen 5 (EPYC), sweeps of the 120 decoder linears at batch 1 without prefetching
    against 2 KiB ahead (5 rounds alternated each, in a 54-62 GB/s hour and a 31-34 GB/s one): bfloat16 1.21x
    and 1.12-1.18x, W8A8 1.08x and 0.95-1.23x (median 1.12x); int4 0.85-0.99x, W8A16 and FP8 0.73-1.08x (hence
    2 KiB for the decoding kernels). A plain 1 GiB read there: 34 GB/s without, 22 with."""
    setting = os.environ.get("INFER_PREFETCH_BYTES", "").strip()
    if setting:
        if not setting.isdigit() or int(setting) % 64:
            raise ValueError(f"INFER_PREFETCH_BYTES={setting!r}: a whole number of 64-byte cache lines (0 turns "
                             f"prefetching off), or unset for this CPU's default")
        return int(setting)
    return 0 if cpu_vendor() == "AuthenticAMD" else 2048


def compile_flags() -> list[str]:
    """The target flags every kernel of the active class is compiled with, and the prefetch distance."""
    chosen = active()
    prefetch = [f"-DINFER_PREFETCH_BYTES={prefetch_bytes()}"]
    if chosen in _MARCH:
        return [*_MARCH[chosen], "-mtune=native", *prefetch]
    flags = ["-march=native", *prefetch]
    if chosen == "avx512bf16" and native_class() == "amx":
        flags += _MNO_AMX
    return flags


def hold_torch_to_class() -> None:
    """Keep torch's own CPU kernels within a forced class (set before torch runs its first kernel)."""
    chosen, native = active(), native_class()
    if chosen is None or chosen == native or chosen not in _TORCH_CAPABILITY:
        return
    aten, onednn = _TORCH_CAPABILITY[chosen]
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten.lower())
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
