"""The sampler's two routes for sampled rows, same run, same logits: torch's ops against the C++ kernel.

torch's route sorts each row for top-k / top-p, then softmax, cumsum and searchsorted; the kernel
(kernels/sample_rows.py) cuts by thresholds and draws by a block scan. Both run through the sampler's own
``sample`` (what a server step calls), on float32 logits of the embedded model's vocabulary, for batches of
1, 16 and 48 rows, temperature alone and with top-p 0.9 at temperature 0.7, alternating call by call;
medians. Each route's draws are checked against the other's distribution on a small vocabulary first, so a
fast wrong kernel cannot pass. ``--artifact`` adds what a user sees: one request's tokens per second through the
engine (128 tokens after a short prompt, the prompt's step included), greedy, at temperature 1, and at temperature
0.7 with top-p 0.9: with the plan's kernel as served (sampled rows in decode bursts too), with it a step at a time,
and with torch's route, alternating, medians of ``--rounds``.

    python -m infer.bench.sampler [--repeats 30] [--artifact DIR [--rounds 3]] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from .throughput import RESULTS, save_json

VOCAB = 49152  # the embedded model's
BATCHES = (1, 16, 48)
SETTINGS = {"temperature 1": {"temperature": 1.0}, "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9}}


def _rows(n: int, **params):
    from infer.runtime.engine.sampling_params import SamplingParams
    from infer.runtime.engine.sequence import Sequence

    return [Sequence("bench", [0], SamplingParams(max_tokens=16, **params)) for _ in range(n)]


def _agree(kernel, gen: torch.Generator) -> float:
    """The largest gap between the two routes' token frequencies over 20,000 draws of a 6-token row at top-p
    0.9 (the standard error is below 0.004)."""
    from infer.runtime.engine.sampler import sample

    logits = torch.randn(6, generator=gen).repeat(20000, 1)
    batch = _rows(20000, temperature=0.8, top_p=0.9)
    freq = [torch.bincount(torch.tensor(sample(logits, batch, k).token_ids), minlength=6).float() / 20000
            for k in (None, kernel)]
    return (freq[0] - freq[1]).abs().max().item()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--artifact", help="also time batch-1 decode through the engine on this artifact (bfloat16)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=RESULTS / "sampler.json")
    args = p.parse_args(argv)
    from infer.kernels import sample_rows
    from infer.runtime.engine.sampler import sample

    module = sample_rows.load()
    if module is None:
        raise SystemExit("the sampler kernel did not build here (below AVX2, or see the warning above)")
    seed = int(time.time())
    print(f"seed {seed}; torch threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(seed)
    gap = _agree(module.draw_rows, gen)
    print(f"frequencies of the two routes, 20,000 draws each: largest gap {gap:.4f}")
    if gap > 0.02:
        raise SystemExit(f"the kernel's draws are off: frequencies {gap:.4f} apart from torch's route")
    rows = []
    for name, params in SETTINGS.items():
        for batch in BATCHES:
            logits, seqs = torch.randn(batch, VOCAB, generator=gen) * 2, _rows(batch, **params)
            times = {"torch": [], "kernel": []}
            for _ in range(args.repeats):  # alternating, so a noisy moment hits both
                for route, kernel in (("torch", None), ("kernel", module.draw_rows)):
                    start = time.perf_counter()
                    sample(logits, seqs, kernel)
                    times[route].append(time.perf_counter() - start)
            row = {"setting": name, "rows": batch, **{f"{r}_ms": round(statistics.median(t) * 1e3, 3)
                                                      for r, t in times.items()}}
            row["speedup"] = round(row["torch_ms"] / row["kernel_ms"], 1)
            rows.append(row)
            print(f"{name:28s} {batch:3d} rows: torch {row['torch_ms']:8.3f} ms  kernel {row['kernel_ms']:7.3f} ms"
                  f"  ({row['speedup']}x)")
    result = {"benchmark": "sampler", "seed": seed, "vocab": VOCAB, "frequency_gap": round(gap, 4), "rows": rows}
    if args.artifact:
        result["batch1"], result["plan"] = _batch1(args.artifact, args.rounds)
    save_json(result, args.json)
    return result


def _batch1(artifact: str, rounds: int) -> tuple[list[dict], dict]:
    """One request's tok/s (128 tokens after a short prompt, its step included) with the plan's draw and torch's."""
    import dataclasses

    from infer.runtime.engine.llm import LLM
    from infer.runtime.engine.sampling_params import SamplingParams

    llm = LLM(artifact, dtype="bfloat16")
    engine, tokens = llm.engine, 128
    # (plan, decode_burst): the kernel as served (sampled rows burst on it too), the kernel a step at a time, and
    # torch's route (which sampled rows cannot burst on)
    bursts = engine.config.decode_burst
    routes = {"kernel": (engine.plan, bursts), "kernel_steps": (engine.plan, 1),
              "torch": (dataclasses.replace(engine.plan, draw_kernel=None), bursts)}
    settings = {"greedy": {"temperature": 0.0}, **SETTINGS}
    llm.generate("Hello", SamplingParams(max_tokens=8))  # warm
    speeds = {(s, r): [] for s in settings for r in routes}
    for _ in range(rounds):
        for name, params in settings.items():
            for route, (plan, burst) in routes.items():
                engine.plan, engine.config.decode_burst = plan, burst
                start = time.perf_counter()
                llm.generate("Tell me about the ocean.", SamplingParams(max_tokens=tokens, ignore_eos=True, **params))
                speeds[name, route].append(tokens / (time.perf_counter() - start))
    engine.plan, engine.config.decode_burst = routes["kernel"]
    rows = []
    for name in settings:
        row = {"setting": name, **{f"{r}_tok_s": round(statistics.median(speeds[name, r]), 1) for r in routes},
               **{f"{r}_rounds": [round(v, 1) for v in speeds[name, r]] for r in routes}}
        row["speedup"] = round(row["kernel_tok_s"] / row["torch_tok_s"], 2)
        rows.append(row)
        print(f"batch 1, {name:28s}: kernel {row['kernel_tok_s']:6.1f} tok/s (a step at a time "
              f"{row['kernel_steps_tok_s']:6.1f})  torch {row['torch_tok_s']:6.1f} tok/s  ({row['speedup']}x)")
    return rows, engine.plan.describe()


if __name__ == "__main__":
    main()
