"""``python -m infer.bench.timeline FILE [--json out.json]``: where a served run's time went.

FILE is what ``infer-run ART --step-trace FILE`` wrote (runtime/serving/trace.py). Printed: steps/s
and the share of wall time, from the first step's start to the last step's end, spent inside
engine steps against between them (idle: no work, or the engine thread handing outputs over);
each phase's share of step time; p50/p99 step duration for decode-only, prefill-only and mixed
steps; p50/p99 event-loop lag, within that same span (the model's loading and an idle tail do not
count), and stream delay (engine hand-over to chunk written).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .serve import percentile

PHASES = ("schedule", "model", "sample", "output")
KINDS = ("decode", "prefill", "mixed")


def load(path: str) -> dict[str, list[dict]]:
    """The trace's records by type; a line cut short by a crash is skipped."""
    by_type: dict[str, list[dict]] = {"step": [], "loop_lag": [], "stream_delay": []}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        by_type.setdefault(record.get("type"), []).append(record)
    return by_type


def step_kind(step: dict) -> str:
    if not step["prefill_seqs"]:
        return "decode"
    return "mixed" if step["decode_rows"] else "prefill"


def distribution(values: list[float]) -> dict:
    return {"count": len(values), "mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values, default=None)}


def summarize(records: dict[str, list[dict]]) -> dict:
    steps = records["step"]
    busy_ms = sum(s["dur_ms"] for s in steps)
    start = min((s["t"] for s in steps), default=-math.inf)
    end = max((s["t"] + s["dur_ms"] / 1e3 for s in steps), default=math.inf)
    span_s = max(end - start, busy_ms / 1e3) if steps else 0.0  # rounding: never less than the steps in it

    return {
        "steps": len(steps), "span_s": span_s, "steps_per_s": len(steps) / span_s if span_s else None,
        "step_share": busy_ms / 1e3 / span_s if span_s else None,
        "idle_share": 1 - busy_ms / 1e3 / span_s if span_s else None,
        "phase_share": {p: (sum(s[f"{p}_ms"] for s in steps) / busy_ms if busy_ms else None) for p in PHASES},
        "prefill_tokens": sum(s["prefill_tokens"] for s in steps),
        "decode_rows": sum(s["decode_rows"] for s in steps),
        "step_ms": {**{k: distribution([s["dur_ms"] for s in steps if step_kind(s) == k]) for k in KINDS},
                    "all": distribution([s["dur_ms"] for s in steps])},
        "loop_lag_ms": distribution([r["lag_ms"] for r in records["loop_lag"] if start <= r["t"] <= end]),
        "stream_delay_ms": distribution([r["delay_ms"] for r in records["stream_delay"]]),
    }


def table(s: dict, path: str) -> str:
    def num(v, fmt=".2f"):
        return "n/a" if v is None else format(v, fmt)

    def pct(v):
        return "n/a" if v is None else f"{v * 100:.1f}%"

    lines = [f"timeline: {path}",
             f"  {s['steps']} steps over {s['span_s']:.2f} s: {num(s['steps_per_s'], '.1f')} steps/s; "
             f"in steps {pct(s['step_share'])}, between steps {pct(s['idle_share'])}",
             "  step time: " + "  ".join(f"{p} {pct(s['phase_share'][p])}" for p in PHASES),
             f"  tokens: {s['prefill_tokens']} prefill, {s['decode_rows']} decode rows",
             "", f"  {'(ms)':<20}{'count':>8}{'p50':>10}{'p99':>10}{'mean':>10}{'max':>10}"]
    rows = [(f"{k} steps", s["step_ms"][k]) for k in (*KINDS, "all")]
    rows += [("event-loop lag", s["loop_lag_ms"]), ("stream delay", s["stream_delay_ms"])]
    for label, d in rows:
        lines.append(f"  {label:<20}{d['count']:>8}{num(d['p50']):>10}{num(d['p99']):>10}{num(d['mean']):>10}"
                     f"{num(d['max']):>10}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.bench.timeline",
                                description="Summarise an infer-run --step-trace file: step rate, busy vs idle, "
                                            "phase shares, step durations by kind, event-loop lag, stream delay.")
    p.add_argument("trace", help="the JSONL file infer-run --step-trace wrote")
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    summary = summarize(load(args.trace))
    print(table(summary, args.trace))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"  json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
