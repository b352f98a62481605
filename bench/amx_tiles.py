"""The AMX linears' tile loop on this CPU: tile loads beside tile products, aligned and not.

The bfloat16 and W8A8 linears on AMX (kernels/csrc/amx_linear.cpp, int8_linear.cpp) block their tiles 2 x 2: four
accumulators, two A tiles (rows of x) and two B tiles (weights), so every 32 k (bfloat16) or 64 k (int8) they load
four tiles for four products, the fewest loads a product that eight tiles allow. This times that loop from L1
(kernels/csrc/peak.cpp's ``amx_tile_loop``) with 0, 1, 2 and 4 of the tiles reloaded an iteration, from 64-byte
aligned rows and from rows 16 bytes off (each 64-byte tile row split over two cache lines, as from a buffer that
malloc returns), against the register-only peak, at the benchmark's thread count. JSON to --json (default
$TMPDIR/infer-bench/amx_tiles.json).

    python -m infer.bench.amx_tiles [--iters 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .throughput import RESULTS, host_info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=RESULTS / "amx_tiles.json")
    args = ap.parse_args(argv)

    from infer.kernels import isa
    from infer.kernels.extension import build

    if isa.active() != "amx":
        raise SystemExit(f"this benchmark needs the amx class; this process runs {isa.active()} (AMX missing, or "
                         f"held off by INFER_ISA / INFER_AMX=0)")
    module = build("infer_peak", "peak.cpp", ["-fopenmp"])
    if module is None:
        raise SystemExit("kernels/csrc/peak.cpp did not build here (see the warning above)")
    peak = max(module.arithmetic_peak(200_000_000 // 12)[0] for _ in range(args.rounds))
    rows = {}
    for offset in (0, 16):
        for loads in (0, 1, 2, 4):
            flops = max(module.amx_tile_loop(args.iters, loads, offset) for _ in range(args.rounds))
            rows[f"{loads} loads, offset {offset}"] = {"gflop_s": flops / 1e9, "share_of_peak": flops / peak}
            print(f"{loads} tile loads per 4 products, rows {offset:2d} bytes off a cache line: {flops / 1e9:7.0f} "
                  f"GFLOP/s, {flops / peak:5.0%} of the tdpbf16ps peak ({peak / 1e9:.0f})")
    result = {"benchmark": "amx_tiles", "host": host_info(), "peak_gflop_s": peak / 1e9, "loops": rows,
              "iters": args.iters, "rounds": args.rounds}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"saved {args.json}")
    return result


if __name__ == "__main__":
    main()
