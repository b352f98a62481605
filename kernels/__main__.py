"""``python -m infer.kernels build [--all-classes]``: compile every C++ kernel this CPU can run, ahead of time.

``make install`` runs it, so neither ``infer-run``'s first answer nor a server's first request
waits for a compiler. Each kernel is its own compiler process (one source each), so the builds run
side by side, one per core. ``--all-classes`` also builds every lower CPU class this CPU can execute
(kernels/isa.py), which a process with ``INFER_ISA`` set loads, and which the test suite runs:
``make install`` passes it. ``python -m infer.kernels`` alone lists what is built and where.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _kernels(cls: str | None) -> dict[str, str]:
    """Kernel name -> the module (kernels/<module>.py) whose ``load()`` builds it for that class, as the
    runtime loads it."""
    kernels = {"layer_ops": "layer_ops", "paged_attention": "cpu_attention"}
    if cls == "amx":
        kernels |= {"amx_linear": "amx_linear", "amx_attention": "amx_attention"}
    if cls is not None:  # every class has AVX2 + FMA
        kernels |= {k: k for k in ("bf16_linear", "int4_linear", "int8_linear", "bf16_attention", "sample_rows",
                                         "step_layers")}
    return kernels


def _build_one(cls: str | None, name: str, module: str) -> tuple[str | None, str, bool, float]:
    """In a fresh process (spawned): the class is set before torch starts, as kernels/isa.py asks."""
    if cls is not None:
        os.environ["INFER_ISA"] = cls
    logging.basicConfig(level=logging.WARNING, format=f"[{cls} {name}] %(message)s")
    t0 = time.perf_counter()
    built = importlib.import_module(f"infer.kernels.{module}").load()
    return cls, name, built is not None, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["build"], ["build", "--all-classes"]):
        print("usage: python -m infer.kernels [build [--all-classes]]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from . import isa
    from .extension import cache_root

    own = isa.active()
    print(f"CPU class: {own} (this CPU's own: {isa.native_class()}; INFER_ISA forces a lower one)")
    print(f"bfloat16 and W8A8 linears prefetch {isa.prefetch_bytes()} bytes ahead "
          f"({isa.cpu_vendor() or 'vendor unknown'}; INFER_PREFETCH_BYTES sets it)")
    classes = [own]
    if "--all-classes" in argv and own is not None:
        classes = list(isa.CLASSES[:isa.CLASSES.index(own) + 1])
    jobs = [(c, name, module) for c in classes for name, module in _kernels(c).items()]
    workers = max(1, min(len(os.sched_getaffinity(0)), len(jobs)))
    failed = []
    t0 = time.perf_counter()
    # the worker by its importable name: under ``python -m`` this module is ``__main__``, which a spawned
    # process cannot look a function up in
    build_one = importlib.import_module("infer.kernels.__main__")._build_one
    # a process per kernel: its class is set before torch starts (kernels/isa.py)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        for cls, name, ok, seconds in pool.map(build_one, *zip(*jobs)):
            state = "ready" if ok else "UNAVAILABLE (torch ops will be used)"
            print(f"{cls or '-':11s} {name:16s} {state} ({seconds:.1f}s)")
            if not ok:
                failed.append(f"{name} ({cls})")
    print(f"{len(jobs)} kernels, {workers} at a time, {time.perf_counter() - t0:.0f}s")
    if own != "amx":
        print("amx_linear, amx_attention: not built (this CPU has no AMX, or INFER_AMX=0)")
    if own is None:
        print("bf16_linear, int4_linear, int8_linear, bf16_attention, step_layers: not built "
              "(this CPU has no AVX2 + FMA)")
    print(f"cache: {cache_root()}")
    if failed:  # not fatal: the runtime falls back to torch ops and says so; the test suite fails on it
        print(f"not built: {', '.join(failed)} (see the warnings above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
