"""Tensor parallelism against one process, on the same machine in the same run: offline throughput
on a fixed request set, and decode step time at a few batch sizes, with the collectives' share.

Pairs measured (each engine loaded alone, then closed, so the ranks never compete with another
engine): the embedded model (SmolLM2-135M) at tp=1 and tp=3 (its 9 query / 3 KV heads divide only
by 3), and a synthetic SmolLM2-sized Llama (random weights: 30 layers, hidden 512, 8 heads, 4 KV
heads, MLP 1536, the embedded tokenizer) at tp=1 and tp=2. A tp=1 engine uses every core; each
of N ranks gets cores // N threads (at least one); tp=1 also runs on one thread, to tell the
sharding's effect from the thread count's on a busy machine. "all-reduce" is rank 0's time inside the
row-parallel all-reduces (waiting for the slowest rank included), "broadcast" its time sending
the step's inputs; their share is of the whole step.

    python -m infer.bench.tp [--requests 16] [--batches 1,4,16] [--dtype float32] [--pairs embedded,synthetic]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from infer.pipeline.stage import copy_carried_files

from .throughput import ARTIFACTS, RESULTS, make_requests, save_json


def _build(source, out: Path, *overrides: str) -> Path:
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    return build(compose_recipe([f"model.source={source}", f"output_dir={out}", "tune.enabled=false",
                                 *overrides])).artifact


def embedded_pair() -> tuple[Path, Path, int]:
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    base = build(compose_recipe([f"output_dir={ARTIFACTS / 'bench-tp-smollm2-tp1'}", "artifact.name=bench-smollm2",
                                 "tune.enabled=false"])).artifact
    return base, _build(base, ARTIFACTS / "bench-tp-smollm2-tp3", "parallel.tp=3", "artifact.name=bench-smollm2"), 3


def synthetic_pair(tokenizer_from: Path) -> tuple[Path, Path, int]:
    import transformers

    src = ARTIFACTS / "bench-tp-synthetic-src"
    if not (src / "model.safetensors").is_file():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                                       tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
        transformers.LlamaForCausalLM(cfg).float().save_pretrained(src, safe_serialization=True)
        copy_carried_files(tokenizer_from, src)
    name = "artifact.name=bench-synthetic"
    return (_build(src, ARTIFACTS / "bench-tp-synthetic-tp1", name),
            _build(src, ARTIFACTS / "bench-tp-synthetic-tp2", "parallel.tp=2", name), 2)


def _collectives(engine) -> tuple[float, float]:
    ranks = engine.ranks
    return (ranks.reduce.seconds, ranks.broadcast_seconds) if ranks else (0.0, 0.0)


def measure(artifact: Path, dtype: str, requests, batches: list[int], steps: int, threads: int | None = None) -> dict:
    from infer.runtime import LLM, SamplingParams

    out: dict = {}
    default = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    with LLM(artifact, dtype=dtype, kv_cache_memory=512 << 20, max_num_seqs=max(16, max(batches))) as llm:
        engine = llm.engine
        out["load_s"] = round(time.perf_counter() - t0, 2)
        out["plan"] = engine.plan.describe()
        out["threads"] = torch.get_num_threads()
        # offline throughput: the fixed request set, greedy, every request its full length
        prompts = [p for p, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        llm.generate(prompts[:2], params[:2])  # warm-up
        r0, b0 = _collectives(engine)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        r1, b1 = _collectives(engine)
        tokens = sum(len(o.token_ids) for o in outs)
        out["offline"] = {"requests": len(requests), "output_tokens": tokens, "seconds": round(wall, 3),
                          "tok_s": round(tokens / wall, 1), "allreduce_share": round((r1 - r0) / wall, 3),
                          "broadcast_share": round((b1 - b0) / wall, 3)}
        out["greedy_tokens"] = [o.token_ids for o in outs]
        # decode step time: b sequences with 128-token prompts, prefilled, then pure decode steps
        out["decode"] = {}
        for b in batches:
            ids = [f"d{b}-{i}" for i in range(b)]
            for rid, (prompt, _) in zip(ids, make_requests(b, engine.model.config.vocab_size, b, (128, 128))):
                engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
            while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
                engine.step()
            engine.step()
            times, reduce, bcast = [], 0.0, 0.0
            for _ in range(steps):
                r0, b0 = _collectives(engine)
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
                r1, b1 = _collectives(engine)
                reduce, bcast = reduce + r1 - r0, bcast + b1 - b0
            for rid in ids:
                engine.abort_request(rid)
            total = sum(times)
            out["decode"][b] = {"step_ms": round(statistics.median(times) * 1e3, 2),
                                "allreduce_ms": round(reduce / steps * 1e3, 2), "broadcast_ms": round(bcast / steps * 1e3, 2),
                                "allreduce_share": round(reduce / total, 3), "broadcast_share": round(bcast / total, 3),
                                "allreduce_calls_per_step": 2 * engine.model.config.num_layers if engine.ranks else 0}
    torch.set_num_threads(default)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--pairs", default="embedded,synthetic")
    p.add_argument("--json", type=Path, default=RESULTS / "tp.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    pairs = {}
    base, sharded, tp = embedded_pair()
    if "embedded" in args.pairs:
        pairs["smollm2-135m"] = (base, sharded, tp)
    if "synthetic" in args.pairs:
        pairs["synthetic-llama-8h"] = synthetic_pair(base)
    requests = make_requests(args.requests, 49152, 0, (32, 256), (16, 64))
    result = {"benchmark": "tp", "dtype": args.dtype, "requests": args.requests, "batches": batches,
              "steps": args.steps, "note": "shared 2-core machine: other jobs ran alongside; compare rows of one run",
              "models": {}}
    rows = []
    for name, (one, many, tp) in pairs.items():
        runs = {}
        for label, artifact, threads in (("tp=1", one, None), ("tp=1 1-thread", one, 1), (f"tp={tp}", many, None)):
            print(f"{name} {label} ...", flush=True)
            runs[label] = measure(artifact, args.dtype, requests, batches, args.steps, threads)
        tokens = {label: r.pop("greedy_tokens") for label, r in runs.items()}
        same = tokens["tp=1"] == tokens[f"tp={tp}"]
        result["models"][name] = {"tp": tp, "greedy_identical": same, "runs": runs}
        for label, r in runs.items():
            o = r["offline"]
            rows.append((name, label, r["threads"], o["tok_s"], o["allreduce_share"], o["broadcast_share"],
                         *(f"{r['decode'][b]['step_ms']:.1f} ({r['decode'][b]['allreduce_share']:.0%})" for b in batches)))
    head = ("model", "tp", "threads/rank", "offline tok/s", "all-reduce", "broadcast",
            *(f"decode b{b} ms (all-reduce)" for b in batches))
    print(" | ".join(head))
    for row in rows:
        print(" | ".join(f"{x:.0%}" if isinstance(x, float) and x < 1 and i in (4, 5) else str(x) for i, x in enumerate(row)))
    for name, m in result["models"].items():
        print(f"{name}: greedy tokens tp=1 vs tp={m['tp']} identical: {m['greedy_identical']}")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
