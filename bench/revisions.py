"""This tree against another git revision on the same benchmarks, same artifact, same run.

A refactor claims "behaviour and speed unchanged"; this checks it. The other revision is checked
out into a temporary ``git worktree`` and put first on ``PYTHONPATH`` under the ``infer.*`` names
(a folder of links, ``infer/pipeline -> WORKTREE/pipeline`` and so on), so each benchmark runs as
its own process against one revision or the other, with that revision's own benchmark script and
kernels (it compiles its kernels on its first run, inside a warm-up that is not timed). Rounds
alternate the order (base, head, head, base, ...), so a host that drifts affects both sides alike;
medians are reported.

    python -m infer.bench.revisions --base REV [--head REV] [--benches offline,single,prefix] [--rounds 2]
                                    [--artifact DIR] [--json PATH]

``--head`` defaults to this working tree; naming a revision checks it out the same way (so edits
made while the benchmark runs cannot reach it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .throughput import RESULTS, default_artifact, save_json

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "runtime", "kernels", "eval", "recipes", "bench")  # the infer.* names (pyproject.toml)
# benchmark: (module args, how to read its headline figures from its JSON: name -> (path, higher is better))
BENCHES = {
    "offline": (["throughput", "--skip-transformers"],
                {"offline tok/s": (("engine", "tokens_per_s"), True)}),
    "single": (["single", "--rounds", "3"],
               {"batch-1 decode tok/s": (("infer", "tokens_per_s"), True)}),
    "prefix": (["prefix", "--bursts", "2"],
               {"sequential TTFT, cached (ms)": (("sequential", "caching_on", "mean_s"), False),
                "sequential TTFT, uncached (ms)": (("sequential", "caching_off", "mean_s"), False),
                "burst TTFT, cached (ms)": (("burst", "caching_on", "mean_s"), False)}),
}


def revision_path(rev: str, scratch: Path) -> Path:
    """A worktree of ``rev`` and a folder that maps the ``infer.*`` packages onto it (for PYTHONPATH)."""
    tree = scratch / "tree"
    scratch.mkdir(parents=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    shim = scratch / "path" / "infer"
    shim.mkdir(parents=True)
    for name in PACKAGES:
        if (tree / name).is_dir():
            (shim / name).symlink_to(tree / name)
    return shim.parent


def remove_revision(scratch: Path) -> None:
    """Undoes ``revision_path(rev, scratch)``: its worktree goes (the folder of links with the scratch folder)."""
    if (scratch / "tree").exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(scratch / "tree")],
                       capture_output=True)


def run_bench(args: list[str], artifact: Path, out: Path, pythonpath: Path | None) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(pythonpath)
    cmd = [sys.executable, "-m", f"infer.bench.{args[0]}", *args[1:], "--artifact", str(artifact), "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def pick(doc: dict, path: tuple[str, ...]) -> float:
    for key in path:
        doc = doc[key]
    return float(doc)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the git revision to compare against (e.g. the commit before a refactor)")
    p.add_argument("--head", default=None, help="the revision to measure against it (default: this working tree)")
    p.add_argument("--benches", default="offline,single,prefix")
    p.add_argument("--rounds", type=int, default=2, help="runs per side and benchmark, order alternating")
    p.add_argument("--artifact", type=Path, help="artifact both revisions load (default: the embedded model, bfloat16)")
    p.add_argument("--json", type=Path, default=RESULTS / "revisions.json")
    args = p.parse_args(argv)
    benches = args.benches.split(",")
    unknown = sorted(set(benches) - set(BENCHES))
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}")
    artifact = args.artifact or default_artifact("bfloat16")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.head or "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = args.head is None and bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                                       "--untracked-files=no"], capture_output=True, text=True).stdout.strip())
    result = {"benchmark": "revisions", "base": args.base, "head": head + ("+changes" if dirty else ""),
              "artifact": str(artifact), "dtype": "bfloat16", "rounds": args.rounds, "benches": {}}
    with tempfile.TemporaryDirectory(prefix="infer-rev-") as tmp:
        scratch = Path(tmp)
        try:
            sides = {"base": revision_path(args.base, scratch / "base"),
                     "head": revision_path(args.head, scratch / "head") if args.head else None}
            for side, path in sides.items():  # warm-up: the base compiles its kernels here
                run_bench(["single", "--rounds", "1", "--tokens", "8"], artifact, scratch / f"warm-{side}.json", path)
            for bench in benches:
                bench_args, figures = BENCHES[bench]
                runs = {"base": [], "head": []}
                for r in range(args.rounds):
                    order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                    for side in order:
                        doc = run_bench(bench_args, artifact, scratch / f"{bench}-{side}-{r}.json", sides[side])
                        runs[side].append({name: pick(doc, path) for name, (path, _) in figures.items()})
                        runs[side][-1]["kernels"] = doc.get("plan", doc.get("kernels"))
                        print(f"[{bench}] round {r + 1} {side}: "
                              + ", ".join(f"{k} {v:.4g}" for k, v in runs[side][-1].items() if k != "kernels"),
                              flush=True)
                rows = {}
                for name, (_, higher) in figures.items():
                    scale = 1e3 if name.endswith("(ms)") else 1.0
                    base = statistics.median(run[name] for run in runs["base"]) * scale
                    new = statistics.median(run[name] for run in runs["head"]) * scale
                    rows[name] = {"base": base, "head": new, "head_vs_base": new / base, "higher_is_better": higher}
                result["benches"][bench] = {"figures": rows, "runs": runs}
        finally:
            for side in ("base", "head"):
                remove_revision(scratch / side)
    print(f"\n{'figure':<34} {args.base[:10]:>12} {result['head']:>14}   head/base")
    for bench in benches:
        for name, row in result["benches"][bench]["figures"].items():
            print(f"{name:<34} {row['base']:>12.1f} {row['head']:>14.1f}   {row['head_vs_base']:.3f}")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
