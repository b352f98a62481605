"""``infer-bench structured``: what a JSON schema costs the engine, against the same prompts unconstrained.

At each batch size the same prompts run twice in one process, interleaved per round: unconstrained
(``ignore_eos``) and held to a JSON schema long enough that neither ends before ``--max-tokens``, so
both generate the same number of tokens. Reported: tokens/s of each and their ratio, the grammar
mask fill time per step (p50/p99; it runs in a worker thread beside the forward), the sampler's time
per step with and without masks, and a first-seen schema's compile time. JSON goes to --json
(default $TMPDIR/infer-bench/structured.json), outside the tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def long_schema(tag: str = "") -> dict:
    """A list of at least 60 people: longer than any --max-tokens this benchmark uses."""
    return {"title": f"people{tag}", "type": "object", "additionalProperties": False, "required": ["people"],
            "properties": {"people": {"type": "array", "minItems": 60, "items": PERSON}}}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def run_batch(llm, prompts: list[str], params) -> tuple[float, int, list]:
    engine = llm.engine
    engine.step_records.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.token_ids) for o in outs), list(engine.step_records)


def main(argv=None) -> None:
    from infer.bench.throughput import host_info, save_json
    from infer.runtime import LLM
    from infer.runtime.engine.sampling_params import SamplingParams
    from infer.runtime.engine.structured import StructuredOutput

    p = argparse.ArgumentParser(prog="infer-bench structured", description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes (default 1 16)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds per batch size (default 1)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", default=str(Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "infer-bench"
                                         / "structured.json"))
    args = p.parse_args(argv)

    llm = LLM(args.artifact, dtype=args.dtype, kv_cache_memory=1 << 30, max_num_seqs=max(args.batch))
    engine = llm.engine
    tok = llm.tokenizer
    schema = StructuredOutput("json", long_schema())
    t0 = time.perf_counter()
    engine.grammars.compile(schema)  # the tokenizer info is built here too
    first_with_tokenizer = time.perf_counter() - t0
    compile_s = []
    for i in range(5):  # first-seen schemas (each title differs), the tokenizer info already built
        t0 = time.perf_counter()
        engine.grammars.compile(StructuredOutput("json", long_schema(f"-{i}")))
        compile_s.append(time.perf_counter() - t0)
    cached_t0 = time.perf_counter()
    engine.grammars.compile(StructuredOutput("json", long_schema()))
    cached_s = time.perf_counter() - cached_t0

    topics = ["engineers", "painters", "sailors", "chemists", "farmers", "pilots", "poets", "bakers"]
    results = {}
    for batch in args.batch:
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"List {topics[i % len(topics)]} with name, "
                                                                        f"age and city, as JSON."}])
                   for i in range(batch)]
        free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        held = SamplingParams(max_tokens=args.max_tokens, temperature=0, structured=schema)
        run_batch(llm, prompts[:1], free)  # warm: first-use costs of both paths out of the figures
        run_batch(llm, prompts[:1], held)
        rows = {"free": [], "json": []}
        fills, sample_ms = [], {"free": [], "json": []}
        for _ in range(args.rounds):
            for name, params in (("free", free), ("json", held)):
                engine.mask_filler.fill_seconds.clear()
                seconds, tokens, steps = run_batch(llm, prompts, params)
                rows[name].append(tokens / seconds)
                sample_ms[name] += [s.sample_ms for s in steps if s.decode_rows]
                if name == "json":
                    fills += engine.mask_filler.fill_seconds
                    assert tokens == batch * args.max_tokens, "a constrained request ended early: lengthen the schema"
        free_tps, json_tps = statistics.median(rows["free"]), statistics.median(rows["json"])
        results[batch] = {
            "tokens_per_s_unconstrained": round(free_tps, 1), "tokens_per_s_json_schema": round(json_tps, 1),
            "ratio": round(json_tps / free_tps, 3), "rounds": args.rounds,
            "mask_fill_ms_p50": round(percentile(fills, 50) * 1e3, 3), "mask_fill_ms_p99": round(percentile(fills, 99) * 1e3, 3),
            "sample_ms_p50_unconstrained": round(percentile(sample_ms["free"], 50), 3),
            "sample_ms_p50_json_schema": round(percentile(sample_ms["json"], 50), 3),
        }
    report = {"host": host_info(), "plan": engine.plan.describe(),
              "artifact": str(args.artifact), "dtype": str(engine.model.dtype), "max_tokens": args.max_tokens,
              "compile_first_schema_with_tokenizer_s": round(first_with_tokenizer, 3),
              "compile_first_seen_schema_s_median": round(statistics.median(compile_s), 4),
              "compile_cached_schema_s": round(cached_s, 6), "batches": results}
    print(f"compile: first schema {first_with_tokenizer:.2f} s (tokenizer info included), first-seen schema "
          f"{statistics.median(compile_s) * 1e3:.1f} ms median, cached {cached_s * 1e6:.0f} us")
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6} {'fill p50 ms':>12} {'fill p99 ms':>12} "
          f"{'sample ms free/json':>20}")
    for batch, r in results.items():
        print(f"{batch:>5} {r['tokens_per_s_unconstrained']:>11} {r['tokens_per_s_json_schema']:>11} {r['ratio']:>6} "
              f"{r['mask_fill_ms_p50']:>12} {r['mask_fill_ms_p99']:>12} "
              f"{r['sample_ms_p50_unconstrained']:>9}/{r['sample_ms_p50_json_schema']}")
    save_json(report, Path(args.json))


if __name__ == "__main__":
    main()
