"""The bfloat16 linear kernel's time by row count (1 to 12 rows: decode steps of a small batch, or a decode
row with its speculative draft's verify rows), at the embedded model's shapes, against its own one-row time.

A verify step of k draft tokens runs k + 1 rows through every linear; what those rows cost over one row is
the verify cost c that the speculative rule weighs (runtime/engine/speculative.py). The kernel reads each
64-column block once for up to 12 rows (kernels/csrc/bf16_linear.cpp); a kernel that re-read it per tile
of rows shows here as odd row counts costing more than even ones. Medians of 7 timings of 20 calls each;
weights random, the same every run. JSON to --json (default $TMPDIR/infer-bench/linear_rows.json).

    python -m infer.bench.linear_rows [--rows 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {"lm_head": (49152, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536), "qkv_proj": (960, 576)}


def timed(f, calls: int = 20, repeats: int = 7) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main(argv=None) -> dict:
    import torch

    from infer.bench.throughput import host_info, save_json
    from infer.kernels import bf16_linear

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--json", type=Path, default=Path(os.environ.get("TMPDIR", tempfile.gettempdir()))
                   / "infer-bench" / "linear_rows.json")
    args = p.parse_args(argv)
    kernel = bf16_linear.load()
    if kernel is None:
        raise SystemExit("the bfloat16 linear kernel did not build on this CPU (it needs AVX2 + FMA at least)")
    gen = torch.Generator().manual_seed(0)
    report = {"host": host_info(), "kernel": "bf16_linear", "rows": list(range(1, args.rows + 1)), "shapes": {}}
    print(f"{'linear':>13} {'N x K':>11}  " + " ".join(f"{m:>6}" for m in report["rows"]) + "  (us; x one row)")
    for name, (n, k) in SHAPES.items():
        packed = bf16_linear.pack((torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16))
        us = []
        for m in report["rows"]:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            us.append(round(timed(lambda: kernel.bf16_linear(x, packed, n, None)) * 1e6, 1))
        report["shapes"][name] = {"n": n, "k": k, "us": us, "x_one_row": [round(t / us[0], 2) for t in us]}
        print(f"{name:>13} {f'{n} x {k}':>11}  " + " ".join(f"{t:>6.0f}" for t in us))
        print(f"{'':>13} {'':>11}  " + " ".join(f"{t / us[0]:>6.2f}" for t in us))
    save_json(report, args.json)  # prints the host
    return report


if __name__ == "__main__":
    main()
