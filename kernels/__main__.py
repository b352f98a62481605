"""``python -m infer.kernels build``: compile every C++ kernel this CPU can run, ahead of time.

``make install`` runs it, so neither ``infer-run``'s first answer nor a server's first request
waits for a compiler. ``python -m infer.kernels`` alone lists what is built and where.
"""

from __future__ import annotations

import logging
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["build"]):
        print("usage: python -m infer.kernels [build]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from . import (amx_attention, amx_linear, bf16_attention, bf16_linear, cpu_attention,
                   int4_linear, int8_linear, layer_ops, step_layers)
    from . import isa
    from .extension import cache_root
    from .resolver import cpu_has_amx

    print(f"CPU class: {isa.active()} (this CPU's own: {isa.native_class()}; INFER_ISA forces a lower one)")
    kernels = {"layer_ops": layer_ops.load, "paged_attention": cpu_attention.load}
    if cpu_has_amx():
        kernels |= {"amx_linear": amx_linear.load, "amx_attention": amx_attention.load}
    if isa.at_least("avx2"):
        kernels |= {"bf16_linear": bf16_linear.load, "int4_linear": int4_linear.load,
                    "int8_linear": int8_linear.load, "bf16_attention": bf16_attention.load,
                    "step_layers": step_layers.load}
    failed = []
    for name, load in kernels.items():
        t0 = time.perf_counter()
        module = load()
        state = "ready" if module is not None else "UNAVAILABLE (torch ops will be used)"
        print(f"{name:16s} {state} ({time.perf_counter() - t0:.1f}s)")
        if module is None:
            failed.append(name)
    if not cpu_has_amx():
        print("amx_linear, amx_attention: not built (this CPU has no AMX)")
    if not isa.at_least("avx2"):
        print("bf16_linear, int4_linear, int8_linear, bf16_attention, step_layers: not built "
              "(this CPU has no AVX2 + FMA)")
    print(f"cache: {cache_root()}")
    if failed:  # not fatal: the runtime falls back to torch ops and says so; the test suite fails on it
        print(f"not built: {', '.join(failed)} (see the warnings above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
