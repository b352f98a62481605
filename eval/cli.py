"""``infer-eval ARTIFACT [--baseline OTHER] [--tasks ...] [--junit PATH]``: the build's metrics and
gates on any artifact, after the fact.

Settings default to what the artifact's own recipe says (its ``eval`` section, gates included);
flags override them. Exit codes: 0 evaluated (every set gate passed), 1 evaluation error,
2 bad arguments or an artifact that fails verification, 3 an accuracy gate failed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_GATE_FAILED = 0, 1, 2, 3
log = logging.getLogger("infer.eval")


def _parser() -> argparse.ArgumentParser:
    from .gates import GATES

    p = argparse.ArgumentParser(
        prog="infer-eval", description=__doc__.split("\n\n")[0],
        epilog="Gates: " + "; ".join(f"{g.name} ({g.description}, {g.op})" for g in GATES.values()) +
               ". Exit codes: 0 ok, 1 evaluation error, 2 bad arguments or artifact, 3 a gate failed.")
    p.add_argument("artifact", help="artifact directory (verified before use)")
    p.add_argument("--baseline", help="artifact to compare against (KL divergence, top-1 and greedy agreement)")
    p.add_argument("--data", help="held-out text: pydoc_topics (default), a .txt or .jsonl file, or a dataset dir")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--stride", type=int)
    p.add_argument("--max-windows", type=int)
    p.add_argument("--prompts", help="greedy-agreement prompts: default, a .txt (one a line) or a .jsonl ('prompt')")
    p.add_argument("--max-prompts", type=int)
    p.add_argument("--greedy-tokens", type=int)
    p.add_argument("--tasks", help="comma-separated lm-eval tasks (shipped, offline: infer_lastword,infer_mc)")
    p.add_argument("--task-limit", type=int, help="documents per task")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=VALUE",
                   help="set a gate threshold (repeatable), e.g. --gate ppl_increase_pct=2")
    p.add_argument("--no-recipe-gates", action="store_true", help="ignore the gates in the artifact's recipe")
    p.add_argument("--junit", help="write JUnit XML here: one test case per gate")
    p.add_argument("--json", dest="json_path", help="write the results (eval.json's format) here")
    p.add_argument("--report", help="write report.md, report.html and plots/ into this directory")
    p.add_argument("-q", "--quiet", action="store_true", help="only the summary and errors")
    return p


def _settings(args, manifest: dict):
    from .settings import EvalSettings

    recipe_eval = (manifest.get("recipe") or {}).get("eval") or {}
    s = EvalSettings.from_spec(recipe_eval)
    for flag, name in (("data", "data"), ("seq_len", "seq_len"), ("stride", "stride"), ("max_windows", "max_windows"),
                       ("prompts", "prompts"), ("max_prompts", "max_prompts"), ("greedy_tokens", "greedy_tokens"),
                       ("task_limit", "task_limit")):
        v = getattr(args, flag)
        if v is not None:
            setattr(s, name, v)
    if args.seq_len is not None and args.stride is None:
        s.stride = s.seq_len  # a window length alone means non-overlapping windows
    if args.tasks is not None:
        s.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    return s, recipe_eval.get("gates") or {}


def _thresholds(args, recipe_gates: dict) -> dict:
    from .gates import GATES

    # the recipe's gates compare against a baseline: without --baseline only explicit --gate flags apply
    use_recipe = not args.no_recipe_gates and args.baseline
    out = {k: v for k, v in recipe_gates.items() if k in GATES} if use_recipe else {}
    for item in args.gate:
        name, sep, value = item.partition("=")
        if not sep or name not in GATES:
            raise ValueError(f"--gate {item!r}: use NAME=VALUE with NAME one of {', '.join(GATES)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--gate {item!r}: {value!r} is not a number") from None
    return out


def summary(doc: dict) -> str:
    ev = doc["evaluation"]
    lines = [f"artifact   {ev['artifact']['path']}",
             f"data       {ev['data']['data']}: {ev['data']['windows']} windows x {ev['data']['seq_len']} tokens, "
             f"stride {ev['data']['stride']}, {ev['data']['tokens_scored']} tokens scored",
             f"perplexity {ev['perplexity']['ppl']:.4f}"]
    if ev.get("comparison") is not None:
        c = ev["comparison"]
        lines += [f"baseline   {ev['baseline']['path']}: perplexity {ev['baseline_perplexity']['ppl']:.4f} "
                  f"({c['ppl_increase_pct']:+.3f}%)",
                  f"KLD        mean {c['mean_kld']:.6f}  median {c['median_kld']:.6f}  p99 {c['p99_kld']:.6f}  "
                  f"max {c['max_kld']:.6f}",
                  f"top-1      {c['top1_agreement']:.4f}   RMS dp {c['rms_delta_p']:.4f}"]
        if "greedy_agreement" in c:
            lines.append(f"greedy     agreement {c['greedy_agreement']:.4f}  exact {c['greedy_exact_match']:.4f} "
                         f"on {c['prompts']} prompts")
    for task, metrics in (ev.get("tasks") or {}).items():
        lines.append(f"task       {task}: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    for g in doc["gates"]:
        if g["passed"] is not None:
            lines.append(("PASS " if g["passed"] else "FAIL ") + g["message"])
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s" if not sys.stderr.isatty() else "%(message)s")
    from infer.runtime.artifact import ArtifactError, dump_json, verify_artifact

    from .gates import evaluate_gates, failed, failure_message, write_junit
    from .metrics import evaluate
    from .settings import EvalError

    try:
        art = verify_artifact(args.artifact)  # each artifact is verified here, once, and handed down
        base = verify_artifact(args.baseline) if args.baseline else None
        settings, recipe_gates = _settings(args, art.manifest)
        thresholds = _thresholds(args, recipe_gates)
        settings.check()
    except (ArtifactError, ValueError) as e:
        print(f"infer-eval: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        evaluation = evaluate(art, base, settings, log=log.info)
    except (EvalError, ValueError, ArtifactError) as e:
        print(f"infer-eval: evaluation failed: {e}", file=sys.stderr)
        return EXIT_ERROR
    gates = evaluate_gates(thresholds, evaluation)
    passed = not failed(gates)
    doc = {"format": "infer-eval", "format_version": 1, "passed": passed, "gates": [g.as_dict() for g in gates],
           "evaluation": evaluation, "recipe": art.manifest.get("recipe"), "stages": [],
           "quantization": {"settings": (art.manifest.get("recipe") or {}).get("quant"),
                            "artifact": art.manifest.get("quantization"), "layer_errors": None}}
    if args.report:
        from .report import write_report

        write_report(Path(args.report), doc)
    if args.json_path:
        Path(args.json_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        dump_json(doc, Path(args.json_path).expanduser())
    if args.junit:
        write_junit(args.junit, gates, artifact=str(art.path))
    print(summary(doc))
    if not passed:
        print(f"infer-eval: {failure_message(gates)}", file=sys.stderr)
        return EXIT_GATE_FAILED
    return EXIT_OK


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
