"""Quantized schemes against bfloat16, speed only, same run: batch-1 decode and a 256-token prefill of each
artifact, rounds interleaved, each decode's bandwidth floor probed just before and just after it.

Give artifacts built from the same bfloat16 model (``model.dtype=bfloat16``), so what each scheme leaves
unquantized (the tied embedding / LM head) is 16-bit in all of them, e.g.

    infer-bench quant-speed --artifact bf16=/tmp/art-bf16 --artifact w8a16=DIR --artifact w8a8=DIR \\
                            --artifact w4a16=DIR [--rounds 5] [--tokens 64] [--prompt-tokens 256]

Every artifact runs with ``dtype=bfloat16``. Decode: a request's time for N tokens minus its time for 1, over
N - 1 tokens (a 16-token prompt). Prefill: a fresh ``--prompt-tokens`` prompt (prefix caching off) with one
output token, prompt tokens over the request's time. The floor: bytes a batch-1 decode step reads (every
tensor at its stored width, bench/single.py's ``weight_bytes``) over the read bandwidth of a large ``sum``
probed around that decode (``bracketed``); each scheme's share is the median of its rate over its own floor in
the rounds whose two probes agree. The table names, per scheme, the
kernels its linears ran on and whether its steps ran as one C++ call. ``--llama-cpp NAME=GGUF`` adds llama.cpp
(llama-cpp-python, 2 threads, in the interpreter ``--llama-python`` names; a process a round) on GGUFs of the
same model, in the same rounds: its floor is the GGUF's bytes (it stores the tied embedding at the file's type).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from infer.runtime.artifact import CONFIG

from .single import bracketed, steady_shares, weight_bytes
from .throughput import RESULTS, make_requests, save_json


def _engine(path: Path):
    from infer.runtime import LLM
    from infer.runtime.model.quant_linear import quantized_modules

    llm = LLM(path, dtype="bfloat16", kv_cache_memory=256 << 20, enable_prefix_caching=False)
    model = llm.engine.model
    linears = Counter(quantized_modules(model).values())
    packed = sum(1 for m in model.modules() if type(m).__name__ == "PackedLinear")
    if packed:
        linears[f"bf16-{llm.engine.kernels.linear_kernel(torch.bfloat16)}"] = packed
    return llm, {"linears": dict(linears), "step": llm.engine.plan.step, "plan": llm.engine.plan.describe()}


# one llama.cpp round in its own interpreter (llama-cpp-python lives in its own venv): decode and prefill as above
_LLAMA_ROUND = r"""
import json, sys, time
from llama_cpp import Llama
path, short1, short2, long, tokens = sys.argv[1], *(json.loads(a) for a in sys.argv[2:5]), int(sys.argv[5])
llm = Llama(model_path=path, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
def gen(prompt, n):
    llm.reset()
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(prompt, temp=0, top_k=1, reset=True)):
        if i + 1 == n:
            break
    return time.perf_counter() - start
gen(short1[:4], 2)  # warm-up
first, full = gen(short1, 1), gen(short2, tokens)
llm.reset()
start = time.perf_counter()
llm.eval(long)
prefill = len(long) / (time.perf_counter() - start)
print(json.dumps({"decode": (tokens - 1) / (full - first), "prefill": prefill}))
"""


def _llama_round(python: str, gguf: Path, short1, short2, long, tokens: int) -> tuple[float, float]:
    import json
    import subprocess

    out = subprocess.run([python, "-c", _LLAMA_ROUND, str(gguf), json.dumps(short1), json.dumps(short2),
                          json.dumps(long), str(tokens)], capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["decode"], r["prefill"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", action="append", required=True, metavar="NAME=DIR",
                   help="a scheme's artifact (repeat); the first is the baseline")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per timed decode request")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the timed prefill's prompt length")
    p.add_argument("--llama-cpp", action="append", default=[], metavar="NAME=GGUF",
                   help="a llama.cpp peer, a GGUF of the same model (repeat), run in rounds with the others")
    p.add_argument("--llama-python", default="python", help="the interpreter that has llama-cpp-python")
    p.add_argument("--json", type=Path, default=RESULTS / "quant_speed.json")
    args = p.parse_args(argv)
    from infer.runtime import SamplingParams
    from infer.runtime.model import ModelConfig

    paths = {}
    for item in args.artifact:
        name, _, path = item.partition("=")
        if not path or not Path(path, CONFIG).is_file():
            raise SystemExit(f"--artifact {item!r}: give NAME=DIR, DIR an artifact (with config.json)")
        paths[name] = Path(path)
    engines, info = {}, {}
    for name, path in paths.items():
        engines[name], info[name] = _engine(path)
        info[name]["weight_bytes"] = weight_bytes(path, "bfloat16")
    peers = {}
    for item in args.llama_cpp:
        name, _, gguf = item.partition("=")
        if not gguf or not Path(gguf).is_file():
            raise SystemExit(f"--llama-cpp {item!r}: give NAME=GGUF, GGUF a file")
        peers[name] = Path(gguf)
        # a step reads every tensor (the tied embedding as the LM head too): the file, less its small header
        info[name] = {"linears": "llama.cpp", "step": None, "weight_bytes": Path(gguf).stat().st_size}
    vocab = ModelConfig.from_dir(next(iter(paths.values()))).vocab_size
    short = [pr for pr, _ in make_requests(2 * args.rounds + 1, vocab, 0, (16, 16))]
    long = [pr for pr, _ in make_requests(args.rounds + 1, vocab, 1, (args.prompt_tokens,) * 2)]

    def run(llm, prompt, tokens):
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == tokens
        return time.perf_counter() - start

    for llm in engines.values():  # warm-up: first calls pay one-off costs
        run(llm, long[-1], 2)
        run(llm, short[-1], 4)
    names = [*engines, *peers]
    decode = {n: [] for n in names}
    prefill = {n: [] for n in names}
    bandwidths = {n: [] for n in names}  # probed just before and after each one's decode (single.bracketed)
    steady = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else list(reversed(names))  # interleaved: A B C, C B A, ...
        for name in order:
            if name in peers:
                (d, f), bandwidth, ok = bracketed(lambda: _llama_round(
                    args.llama_python, peers[name], short[2 * r], short[2 * r + 1], long[r], args.tokens))
                decode[name].append(d)
                prefill[name].append(f)
            else:
                llm = engines[name]
                (first, full), bandwidth, ok = bracketed(
                    lambda: (run(llm, short[2 * r], 1), run(llm, short[2 * r + 1], args.tokens)))
                decode[name].append((args.tokens - 1) / (full - first))
                prefill[name].append(args.prompt_tokens / run(llm, long[r], 1))
            bandwidths[name].append(bandwidth)
            steady[name].append(ok)
    base = next(iter(engines))
    result = {"benchmark": "quant_speed", "dtype": "bfloat16", "rounds": args.rounds, "tokens": args.tokens,
              "prompt_tokens": args.prompt_tokens, "threads": torch.get_num_threads(),
              "schemes": {}}
    header = (f"{'scheme':<8} {'MB/step':>8} {'decode tok/s (min-max)':>24} {'floor':>6} {'share':>6} {'x base':>6} "
              f"{'prefill tok/s (min-max)':>26} {'x base':>6}  linears / one-call step")
    print(header)
    for name in names:
        floors = [b / info[name]["weight_bytes"] for b in bandwidths[name]]
        shares = steady_shares(decode[name], floors, steady[name])
        row = {**info[name], "decode_tok_s": statistics.median(decode[name]), "decode_rounds": decode[name],
               "read_gb_s_rounds": [b / 1e9 for b in bandwidths[name]], "steady_rounds": steady[name],
               "floor_tok_s": statistics.median(floors),
               "share_of_floor": statistics.median(shares) if shares else None,
               "share_rounds": shares, "prefill_tok_s": statistics.median(prefill[name]),
               "prefill_rounds": prefill[name]}
        row["decode_x_base"] = row["decode_tok_s"] / statistics.median(decode[base])
        row["prefill_x_base"] = row["prefill_tok_s"] / statistics.median(prefill[base])
        result["schemes"][name] = row
        print(f"{name:<8} {row['weight_bytes'] / 1e6:>8.0f} {row['decode_tok_s']:>8.1f} "
              f"({min(decode[name]):.1f}-{max(decode[name]):.1f}){'':>4} {row['floor_tok_s']:>6.1f} "
              f"{'-' if row['share_of_floor'] is None else format(row['share_of_floor'], '.0%'):>6} "
              f"{row['decode_x_base']:>6.2f} {row['prefill_tok_s']:>10.0f} "
              f"({min(prefill[name]):.0f}-{max(prefill[name]):.0f}){'':>4} {row['prefill_x_base']:>6.2f}  "
              f"{row['linears']} / {row['step']}")
    print(f"read bandwidth around {base}'s decodes, round by round: "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidths[base])} GB/s; share: the median over the rounds whose "
          f"probes before and after agree (steady rounds: "
          f"{', '.join(f'{n} {sum(steady[n])}/{args.rounds}' for n in names)})")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
