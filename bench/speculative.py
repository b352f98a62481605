"""``infer-bench speculative``: batch-1 decode with n-gram speculation against without, same process.

Two committed prompt sets (bench/prompts/): ``grounded`` (quoting, extracting from and editing a
given text: where prompt lookup finds drafts) and ``chat`` (open questions: where it mostly finds
none, and must not slow decoding down). Each prompt runs alone (batch 1), greedy, to
``--max-tokens``; three engines take turns on each prompt, the order alternating: no speculation, n-gram
drafts of the adaptive length (at most K, runtime/engine/speculative.py's draft_length) and of K
always; with ``--draft DIR``, a fourth: a draft artifact's greedy tokens, adaptive k
(runtime/engine/draft_model.py). Reported per set and mode: tokens/s, the speed-up over no speculation, the mean tokens a
verifying step emits (acceptance length) and the share of drafted tokens accepted, and whether the
outputs were identical. JSON to --json (default
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


MODES = ("off", "adaptive", "fixed")  # no speculation; n-gram with k chosen per step; n-gram with k always K


def main(argv=None) -> None:
    from infer.bench.throughput import host_info, save_json
    from infer.runtime import LLM, SamplingParams

    p = argparse.ArgumentParser(prog="infer-bench speculative", description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: the engine's)")
    p.add_argument("--verify-cost", type=float, default=None,
                   help="the adaptive k's verify-row cost c (default: measured by each engine from its own steps)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dtype", default=None)
    p.add_argument("--draft", default=None, metavar="DIR", help="also a draft artifact's drafts (mode 'draft')")
    p.add_argument("--json", default=str(Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "infer-bench"
                                         / "speculative.json"))
    args = p.parse_args(argv)

    modes = MODES + (("draft",) if args.draft else ())

    def engine(mode: str):
        method = {"off": "off", "draft": "draft"}.get(mode, "ngram")
        return LLM(args.artifact, dtype=args.dtype, kv_cache_memory=512 << 20, speculative=method,
                   num_speculative_tokens=args.num_speculative_tokens, speculative_adaptive=mode != "fixed",
                   speculative_verify_cost=args.verify_cost, speculative_draft=args.draft if mode == "draft" else None)

    engines = {mode: engine(mode) for mode in modes}
    tok = engines["off"].tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for llm in engines.values():  # warm: first-use costs out of the figures
        llm.generate([tok.apply_chat_template([{"role": "user", "content": "Say hi. Say hi."}])], params)
    report = {"host": host_info(), "plan": engines["off"].engine.plan.describe(),
              "artifact": str(args.artifact), "max_tokens": args.max_tokens,
              "num_speculative_tokens": engines[modes[1]].engine.proposer.config.num_tokens, "verify_cost": args.verify_cost,
              "draft": args.draft, "sets": {}}
    keys = ("spec_steps", "spec_drafted", "spec_accepted", "spec_emitted")
    for name in SETS:
        prompts = [tok.apply_chat_template(m) for m in load_set(name)]
        rates = {mode: [] for mode in modes}
        stats0 = {mode: dict(llm.engine.stats) for mode, llm in engines.items()}
        for r in range(args.rounds):
            tokens, seconds, outs = ({mode: 0 for mode in modes}, {mode: 0.0 for mode in modes},
                                     {mode: [] for mode in modes})
            for i, prompt in enumerate(prompts):  # one at a time: batch 1
                # every mode on each prompt in turn, the order alternating prompt to prompt: a host whose speed
                # shifts for minutes at a time (these do) shifts every mode alike
                for mode in (modes if (r + i) % 2 == 0 else modes[::-1]):
                    t0 = time.perf_counter()
                    out = engines[mode].generate([prompt], params)[0]
                    seconds[mode] += time.perf_counter() - t0
                    tokens[mode] += len(out.token_ids)
                    outs[mode].append(out.token_ids)
            for mode in modes:
                rates[mode].append(tokens[mode] / seconds[mode])
            texts = outs
        off = statistics.median(rates["off"])
        row = {"prompts": len(prompts), "rounds": args.rounds, "tokens_per_s_off": round(off, 1),
               "rounds_off": [round(x, 1) for x in rates["off"]]}
        for mode in modes[1:]:
            s = {k: engines[mode].engine.stats[k] - stats0[mode][k] for k in keys}
            on = statistics.median(rates[mode])
            row[mode] = {"tokens_per_s": round(on, 1), "rounds": [round(x, 1) for x in rates[mode]],
                         "speedup": round(on / off, 3),
                         "acceptance_length": round(s["spec_emitted"] / s["spec_steps"], 2) if s["spec_steps"] else None,
                         "accepted_share": round(s["spec_accepted"] / s["spec_drafted"], 3) if s["spec_drafted"] else None,
                         "identical_outputs": sum(a == b for a, b in zip(texts["off"], texts[mode])),
                         "verify_cost": round(engines[mode].engine.proposer.cost.value, 4), **s}
        report["sets"][name] = row
    print(f"{'set':>9} {'mode':>9} {'tok/s':>8} {'off tok/s':>10} {'speed-up':>9} {'accept len':>11} {'accepted':>9} "
          f"{'identical':>10} {'c':>6}")
    for name, r in report["sets"].items():
        for mode in modes[1:]:
            m = r[mode]
            print(f"{name:>9} {mode:>9} {m['tokens_per_s']:>8} {r['tokens_per_s_off']:>10} {m['speedup']:>9} "
                  f"{m['acceptance_length']!s:>11} {m['accepted_share']!s:>9} {m['identical_outputs']:>5}/{r['prompts']} {m['verify_cost']:>6}")
    save_json(report, Path(args.json))


if __name__ == "__main__":
    main()
