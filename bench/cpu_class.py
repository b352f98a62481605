"""Speed on this CPU class against its own limits, and against llama.cpp, in one run.

Per round, for each artifact: the read bandwidth (a 1 GiB ``sum``) and the arithmetic peak (a
register-only loop of the instruction the class's linears multiply with, kernels/csrc/peak.cpp), then
batch-1 decode (a 128-token prompt; N tokens minus 1 token, over N - 1) and the prefill of a fresh
256-token prompt (prefix caching off; after one untimed prefill of another, as a running server has had).
Decode is set against the floor (the bytes a step reads / bandwidth) probed just before and just after it
(bench/single.py's ``bracketed``: a decode whose two probes disagree by more than STEADY has no floor, and
its round stays out of the median share), prefill against that round's peak, with

    FLOPs = 2 x decoder linear parameters x T + causal attention 2 x 2 x layers x heads x head_dim x T(T+1)/2
            + 2 x LM head parameters (the last token's logits only).

``--llama-python PY --gguf FILE`` runs llama.cpp (llama-cpp-python in the interpreter PY, same threads) on
the same prompts in each round, after infer. ``--isa CLASS`` forces a lower CPU class (kernels/isa.py)
before anything is loaded. Rounds alternate the artifacts' order.

    python -m infer.bench.cpu_class --artifact BF16_DIR [--artifact W4A16_DIR] [--rounds 3] [--isa avx2]
        [--llama-python /path/venv/bin/python --gguf model-f16.gguf] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infer.runtime.artifact import CONFIG

DECODE_TOKENS, PROMPT, PREFILL = 64, 128, 256

_LLAMA = r"""
import json, sys, time, llama_cpp
gguf, threads, prompt, prefill, tokens = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
llm = llama_cpp.Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
def gen(n):
    llm.reset(); start = time.perf_counter(); count = 0
    for _ in llm.generate(prompt, temp=0, top_k=1, reset=True):
        count += 1
        if count == n: break
    return time.perf_counter() - start
gen(4)
one, many = gen(1), gen(tokens)
llm.reset(); start = time.perf_counter(); llm.eval(prefill); t = time.perf_counter() - start
print(json.dumps({"decode_tok_s": (tokens - 1) / (many - one), "prefill_tok_s": len(prefill) / t}))
"""


def flops_of_prefill(config: dict, tokens: int) -> float:
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    d = config.get("head_dim") or h // heads
    linear = layers * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter)
    attention = 2 * 2 * layers * heads * d * tokens * (tokens + 1) / 2
    return 2 * linear * tokens + attention + 2 * config["vocab_size"] * h


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, action="append", required=True, help="repeat for several artifacts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--isa", default=None, help="force this CPU class (kernels/isa.py), lower than the CPU's")
    p.add_argument("--llama-python", type=Path, help="a Python with llama-cpp-python installed")
    p.add_argument("--gguf", type=Path, help="the GGUF llama.cpp runs (e.g. an F16 file of the same model)")
    p.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "infer-bench" / "cpu_class.json")
    args = p.parse_args(argv)
    if args.isa:
        os.environ["INFER_ISA"] = args.isa
    from infer.kernels import isa

    isa.active()  # a bad --isa fails here, before anything loads
    isa.hold_torch_to_class()
    import torch

    from infer.kernels.extension import build
    from infer.runtime import LLM, SamplingParams

    from .single import bracketed, read_bandwidth, steady_shares, weight_bytes
    from .throughput import host_info, save_json

    peak_module = build("infer_peak", "peak.cpp", ["-fopenmp"])
    threads = torch.get_num_threads()
    engines = {}
    for artifact in args.artifact:
        config = json.loads((artifact / CONFIG).read_text())
        llm = LLM(artifact, dtype="bfloat16", kv_cache_memory=256 << 20, enable_prefix_caching=False)
        engines[artifact.name] = {"llm": llm, "config": config, "bytes": weight_bytes(artifact, "bfloat16"),
                                  "plan": llm.engine.plan.describe()}
    vocab = next(iter(engines.values()))["config"]["vocab_size"]
    rows = {name: {"decode": [], "prefill": [], "floor_share": [], "peak_share": [], "read_gb_s": [], "steady": []}
            for name in engines}
    llama_rows = {"decode": [], "prefill": []}
    probes = {"read_gb_s": [], "peak_gflop_s": []}
    for r in range(args.rounds):
        bandwidth = read_bandwidth()
        peak, instruction = peak_module.arithmetic_peak(200_000_000 // 12) if peak_module else (float("nan"), "none")
        probes["read_gb_s"].append(bandwidth / 1e9)
        probes["peak_gflop_s"].append(peak / 1e9)
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        prompt, prefill, warm_prefill = _prompt(vocab, PROMPT, r), _prompt(vocab, PREFILL, 1000 + r), _prompt(vocab, PREFILL, 2000 + r)
        for name in order:
            e, row = engines[name], rows[name]
            llm = e["llm"]

            def timed(ids, n):
                start = time.perf_counter()
                out = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
                assert len(out.token_ids) == n
                return time.perf_counter() - start

            timed(prompt, 2)  # warm: the first steps of a size allocate (and fault in) their buffers
            # the decode's floor probed just before and after it (bench/single.py, bracketed)
            (one, many), around, steady = bracketed(lambda: (timed(prompt, 1), timed(prompt, DECODE_TOKENS)))
            decode = (DECODE_TOKENS - 1) / (many - one)
            timed(warm_prefill, 1)
            fill = PREFILL / timed(prefill, 1)
            row["decode"].append(decode)
            row["prefill"].append(fill)
            row["read_gb_s"].append(around / 1e9)
            row["steady"].append(steady)
            row["floor_share"].append(decode / (around / e["bytes"]))
            row["peak_share"].append(fill * flops_of_prefill(e["config"], PREFILL) / PREFILL / peak)
            print(f"round {r + 1} {name}: decode {decode:.1f} tok/s ({row['floor_share'][-1]:.0%} of floor"
                  f"{'' if steady else ': probes disagree, no floor'}), prefill {fill:.0f} tok/s "
                  f"({row['peak_share'][-1]:.0%} of peak) | read {around / 1e9:.1f} GB/s around the decode, "
                  f"peak {peak / 1e9:.0f} GFLOP/s ({instruction})", flush=True)
        if args.llama_python and args.gguf:
            out = subprocess.run([str(args.llama_python), "-c", _LLAMA, str(args.gguf), str(threads), json.dumps(prompt),
                                  json.dumps(prefill), str(DECODE_TOKENS)], capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            llama_rows["decode"].append(got["decode_tok_s"])
            llama_rows["prefill"].append(got["prefill_tok_s"])
            print(f"round {r + 1} llama.cpp ({args.gguf.name}): decode {got['decode_tok_s']:.1f} tok/s, "
                  f"prefill {got['prefill_tok_s']:.0f} tok/s", flush=True)

    def summary(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}

    def steady_summary(row: dict, nbytes: int) -> dict | None:
        """The floor shares of the rounds whose decode had a steady floor (None: not one)."""
        shares = steady_shares(row["decode"], [gb_s * 1e9 / nbytes for gb_s in row["read_gb_s"]], row["steady"])
        return summary(shares) if shares else None

    result = {"host": host_info(), "isa": isa.active(), "threads": threads, "instruction": instruction,
              "probes": {k: summary(v) for k, v in probes.items()},
              "prefill_tokens": PREFILL, "decode_tokens": DECODE_TOKENS, "prompt_tokens": PROMPT,
              "artifacts": {name: {"weight_bytes": e["bytes"], "plan": e["plan"],
                                   "prefill_flops": flops_of_prefill(e["config"], PREFILL),
                                   **{k: summary(v) for k, v in rows[name].items() if k != "steady"},
                                   "steady": rows[name]["steady"], "steady_floor_share": steady_summary(rows[name], e["bytes"])}
                            for name, e in engines.items()},
              "command": " ".join([os.path.basename(sys.executable), "-m", "infer.bench.cpu_class", *(argv or sys.argv[1:])])}
    if llama_rows["decode"]:
        result["llama_cpp"] = {"gguf": str(args.gguf), **{k: summary(v) for k, v in llama_rows.items()}}
    print(f"\nhost: {result['host']}, class {result['isa']}, {threads} threads; "
          f"read {result['probes']['read_gb_s']['median']:.1f} GB/s, peak {result['probes']['peak_gflop_s']['median']:.0f} "
          f"GFLOP/s ({instruction})")
    for name, a in result["artifacts"].items():
        share = a["steady_floor_share"]
        share = (f"{share['median']:.0%} of floor, {len(share['rounds'])} steady rounds" if share
                 else "no steady round")
        print(f"{name:40s} decode {a['decode']['median']:6.1f} tok/s ({share})  "
              f"prefill {a['prefill']['median']:6.0f} tok/s ({a['peak_share']['median']:.0%} of peak)  "
              f"linears {(a['plan'] or {}).get('linears')}")
    if "llama_cpp" in result:
        lc = result["llama_cpp"]
        print(f"{'llama.cpp ' + args.gguf.name:40s} decode {lc['decode']['median']:6.1f} tok/s"
              f"{'':17s}prefill {lc['prefill']['median']:6.0f} tok/s")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
