"""Shared-prefix benchmark: time to first token with prefix caching on and off, same requests.

32 requests share a 400-token system prompt and differ in a short user question (16-48 tokens).
Two arrival patterns, each with caching on and off:

- sequential: one after another, each measured from arrival to its first token, after one
  warm-up request that puts the system prompt in the cache. With caching on, each prefill
  computes only the question; off, the whole prompt. This isolates the per-request saving,
  which on a CPU is bounded by how much less efficiently the matmuls run at ~30 tokens than at
  ~430 tokens.
- burst: all 32 arrive at once on a cold cache (as when many users of one deployment hit it
  together); TTFT includes queueing. With caching on, the first request computes the system
  prompt once and the others reuse it. ``--bursts`` bursts per engine, each with its own prompt.

Both engines stay loaded and take turns (request by request, burst by burst), so a machine that
speeds up or slows down during the run affects both sides alike.

    python -m infer.bench.prefix [--artifact DIR] [--requests 32] [--prefix-tokens 400]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from .throughput import add_common_args, prepare, save_json


def make_prompts(n: int, prefix_tokens: int, vocab: int, seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(prefix_tokens)]
    return [system + [rng.randrange(100, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n + 1)]


def _summary(ttfts: list[float], bm, queries: int = 0, hits: int = 0) -> dict:
    return {"mean_s": statistics.mean(ttfts), "median_s": statistics.median(ttfts),
            "p90_s": sorted(ttfts)[int(0.9 * len(ttfts))], "prefix_queries": bm.prefix_queries - queries,
            "prefix_hits": bm.prefix_hits - hits}


def _finish(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def sequential_ttft(engines: dict, prompts) -> dict:
    """Each request runs on the caching-on engine, then on the caching-off one: drift hits both alike."""
    from infer.runtime import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    ttfts = {caching: [] for caching in engines}
    counters = {}
    for i, prompt in enumerate(prompts):
        for caching, engine in engines.items():
            start = time.perf_counter()
            engine.add_request(f"s{i}", prompt, params)
            _finish(engine)
            if i:  # the first request only warms up (and, with caching on, fills the cache)
                ttfts[caching].append(time.perf_counter() - start)
            else:
                counters[caching] = (engine.block_manager.prefix_queries, engine.block_manager.prefix_hits)
    return {caching: _summary(ttfts[caching], engines[caching].block_manager, *counters[caching])
            for caching in engines}


def burst_ttft(engines: dict, bursts) -> dict:
    """Bursts alternate between the engines; each burst has its own system prompt, so starts cold."""
    from infer.runtime import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    ttfts = {caching: [] for caching in engines}
    counters = {caching: (e.block_manager.prefix_queries, e.block_manager.prefix_hits) for caching, e in engines.items()}
    for b, prompts in enumerate(bursts):
        for caching, engine in engines.items():
            arrival = time.perf_counter()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"b{b}-{i}", prompt, params)
            while engine.has_unfinished_requests():
                ttfts[caching] += [time.perf_counter() - arrival for out in engine.step() if out.finished]
    return {caching: _summary(ttfts[caching], engines[caching].block_manager, *counters[caching])
            for caching in engines}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "prefix.json")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bursts", type=int, default=2, help="bursts per engine, alternating (default 2)")
    args = p.parse_args(argv)
    artifact = prepare(args)
    from infer.runtime.model import ModelConfig

    from infer.runtime import LLMEngine, SamplingParams

    vocab = ModelConfig.from_dir(artifact).vocab_size
    engines = {caching: LLMEngine(artifact, dtype=args.dtype, enable_prefix_caching=caching, kv_cache_memory=1 << 30)
               for caching in (True, False)}
    for engine in engines.values():  # warm the code paths on an unrelated prompt
        engine.add_request("warmup", make_prompts(0, args.prefix_tokens, vocab, args.seed + 999)[0],
                           SamplingParams(max_tokens=1))
        _finish(engine)
    result = {"benchmark": "shared_prefix_ttft", "requests": args.requests, "prefix_tokens": args.prefix_tokens,
              "dtype": args.dtype, "threads": args.threads, "bursts": args.bursts, "plan": engines[True].plan.describe()}
    runs = {"sequential": sequential_ttft(engines, make_prompts(args.requests, args.prefix_tokens, vocab, args.seed)),
            "burst": burst_ttft(engines, [make_prompts(args.requests - 1, args.prefix_tokens, vocab, args.seed + 1 + b)
                                          for b in range(args.bursts)])}
    for mode, (on, off) in ((m, (r[True], r[False])) for m, r in runs.items()):
        result[mode] = {"caching_on": on, "caching_off": off, "speedup": off["mean_s"] / on["mean_s"]}
        print(f"[{mode}] TTFT, prefix caching on : mean {on['mean_s'] * 1e3:.1f} ms, median "
              f"{on['median_s'] * 1e3:.1f} ms (hit {on['prefix_hits']}/{on['prefix_queries']} prompt tokens)")
        print(f"[{mode}] TTFT, prefix caching off: mean {off['mean_s'] * 1e3:.1f} ms, median "
              f"{off['median_s'] * 1e3:.1f} ms")
        print(f"[{mode}] speedup                 : {result[mode]['speedup']:.1f}x")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
