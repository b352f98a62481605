"""``infer-bench speculative``: batch-1 decode with n-gram speculation against without, same process.

Two committed prompt sets (bench/prompts/): ``grounded`` (quoting, extracting from and editing a
given text: where prompt lookup finds drafts) and ``chat`` (open questions: where it mostly finds
none, and must not slow decoding down). Each prompt runs alone (batch 1), greedy, to
``--max-tokens``; the two engines take turns per round. Reported per set: tokens/s of each, the
speed-up, the mean tokens a verifying step emits (acceptance length) and the share of drafted tokens
accepted, and whether the outputs were identical. JSON to --json (default
$TMPDIR/infer-bench/speculative.json), outside the tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = Path(__file__).parent / "prompts"
SETS = ("grounded", "chat")


def load_set(name: str) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in (PROMPTS / f"speculative-{name}.jsonl").read_text().splitlines()]


def main(argv=None) -> None:
    from infer.bench.throughput import host_info, save_json
    from infer.runtime import LLM, SamplingParams

    p = argparse.ArgumentParser(prog="infer-bench speculative", description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", default=str(Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "infer-bench"
                                         / "speculative.json"))
    args = p.parse_args(argv)

    engines = {mode: LLM(args.artifact, dtype=args.dtype, kv_cache_memory=512 << 20, speculative=mode,
                         num_speculative_tokens=args.num_speculative_tokens) for mode in ("off", "ngram")}
    tok = engines["off"].tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for llm in engines.values():  # warm: first-use costs out of the figures
        llm.generate([tok.apply_chat_template([{"role": "user", "content": "Say hi. Say hi."}])], params)
    report = {"host": host_info(), "kernels": engines["off"].engine.kernels.describe(engines["off"].engine.model.dtype),
              "artifact": str(args.artifact), "max_tokens": args.max_tokens,
              "num_speculative_tokens": args.num_speculative_tokens, "sets": {}}
    for name in SETS:
        prompts = [tok.apply_chat_template(m) for m in load_set(name)]
        rates = {"off": [], "ngram": []}
        texts = {}
        stats0 = dict(engines["ngram"].engine.stats)
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                tokens, seconds, outs = 0, 0.0, []
                for prompt in prompts:  # one at a time: batch 1
                    t0 = time.perf_counter()
                    out = llm.generate([prompt], params)[0]
                    seconds += time.perf_counter() - t0
                    tokens += len(out.token_ids)
                    outs.append(out.token_ids)
                rates[mode].append(tokens / seconds)
                texts[mode] = outs
        s = {k: engines["ngram"].engine.stats[k] - stats0[k] for k in ("spec_steps", "spec_drafted", "spec_accepted",
                                                                       "spec_emitted")}
        off, on = statistics.median(rates["off"]), statistics.median(rates["ngram"])
        report["sets"][name] = {
            "prompts": len(prompts), "tokens_per_s_off": round(off, 1), "tokens_per_s_ngram": round(on, 1),
            "speedup": round(on / off, 3), "rounds": args.rounds,
            "acceptance_length": round(s["spec_emitted"] / s["spec_steps"], 2) if s["spec_steps"] else None,
            "accepted_share": round(s["spec_accepted"] / s["spec_drafted"], 3) if s["spec_drafted"] else None,
            "identical_outputs": sum(a == b for a, b in zip(texts["off"], texts["ngram"])), **s}
    print(f"{'set':>9} {'off tok/s':>10} {'ngram tok/s':>12} {'speed-up':>9} {'accept len':>11} {'accepted':>9} "
          f"{'identical':>10}")
    for name, r in report["sets"].items():
        print(f"{name:>9} {r['tokens_per_s_off']:>10} {r['tokens_per_s_ngram']:>12} {r['speedup']:>9} "
              f"{r['acceptance_length']!s:>11} {r['accepted_share']!s:>9} {r['identical_outputs']:>5}/{r['prompts']}")
    save_json(report, Path(args.json))


if __name__ == "__main__":
    main()
