"""The tuned artifact against the untuned one: decode step time at every bucket, same run, same host.

Both engines load the same artifact, one following its tuning.json (``tuning=auto``), one the
defaults (``tuning=off``); at each bucket both hold that many sequences with ~256-token contexts
and time decode steps in alternation (median of rounds). The table says where the tuning changed a
choice and what the tuned engine gained at each bucket.

    python -m infer.bench.tune [--artifact DIR] [--buckets 1,2,4,8,16,32,64] [--rounds 5] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from .throughput import RESULTS, default_artifact, make_requests, save_json


def _engine(artifact: Path, tuning: str, batch: int):
    from infer.runtime import LLMEngine

    # one decode step an engine.step(): with bursts on, a step ran up to 8 of them, as many as fit its time budget,
    # so the two engines' "steps" held different numbers of decode steps
    return LLMEngine(artifact, tuning=tuning, max_num_seqs=batch, kv_cache_memory=1 << 30, decode_burst=1)


def _fill(engine, batch: int, vocab: int) -> None:
    """``batch`` running sequences, prompts computed, each about to decode."""
    from infer.runtime import SamplingParams

    for rid in list(engine.requests):
        engine.abort_request(rid)
    for i, (prompt, _) in enumerate(make_requests(batch, vocab, batch, (240, 270))):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", prompt,
                           SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0))
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()


def _step_seconds(engine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, help="a tuned artifact (default: build the embedded model, bfloat16)")
    p.add_argument("--buckets", default="1,2,4,8,16,32,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", type=Path, default=RESULTS / "tune.json")
    args = p.parse_args(argv)
    artifact = args.artifact or default_artifact("bfloat16")
    buckets = [int(b) for b in args.buckets.split(",")]
    largest = max(buckets)
    tuned, plain = _engine(artifact, "auto", largest), _engine(artifact, "off", largest)
    if tuned.tuning is None:
        raise SystemExit(f"{artifact}: no tuning.json measured on this hardware; build it here (tune.enabled=true)")
    threads = torch.get_num_threads()
    vocab = tuned.model.config.vocab_size
    rows = []
    for b in buckets:
        times = {"tuned": [], "default": []}
        for engine in (tuned, plain):
            _fill(engine, b, vocab)
        for _ in range(args.rounds):
            for name, engine in (("tuned", tuned), ("default", plain)):
                times[name].append(_step_seconds(engine, args.steps))
                torch.set_num_threads(threads)  # the tuned runner may have changed it
        med = {k: statistics.median(v) for k, v in times.items()}
        from infer.runtime.tuning import bucket_for

        bk = str(bucket_for(b, tuned.tuning.buckets))
        table = tuned.tuning.table
        changed = [f"{sec}: {table[sec][bk]['default']} -> {table[sec][bk]['choice']}"
                   for sec in ("decode_attention", "threads") if bk in table.get(sec, {})
                   and str(table[sec][bk]["choice"]) != str(table[sec][bk]["default"])]
        rows.append({"batch": b, "tuned_step_s": med["tuned"], "default_step_s": med["default"],
                     "speedup": med["default"] / med["tuned"], "changed": changed, "rounds": times})
        print(f"batch {b:3d}: tuned {med['tuned'] * 1e3:7.1f} ms, default {med['default'] * 1e3:7.1f} ms, "
              f"{med['default'] / med['tuned']:.2f}x  {'; '.join(changed) or '(same choices)'}")
    linear = [c for c in tuned.tuning.changed() if c.startswith("linear")]
    print("linear kernels changed at load:", "; ".join(linear) or "none")
    result = {"benchmark": "tune", "artifact": str(artifact), "dtype": str(tuned.model.dtype).removeprefix("torch."),
              "plan": tuned.plan.describe(), "tuning_changed": tuned.tuning.changed(),
              "tuning_hardware": tuned.tuning.table["hardware"], "rows": rows}
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
