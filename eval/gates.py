"""Accuracy gates: thresholds on evaluation metrics, each with a verdict a release pipeline can act on."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr


@dataclass(frozen=True)
class GateDef:
    name: str  # the recipe key under eval.gates
    metric: str  # the key under evaluation["comparison"]
    op: str  # "<=" or ">="
    unit: str
    description: str


GATES: dict[str, GateDef] = {g.name: g for g in (
    GateDef("ppl_increase_pct", "ppl_increase_pct", "<=", "%", "perplexity increase over the baseline, percent"),
    GateDef("top1_agreement_min", "top1_agreement", ">=", "", "share of tokens whose top-1 prediction matches the baseline's"),
    GateDef("mean_kld_max", "mean_kld", "<=", "", "mean KL divergence of next-token distributions from the baseline's"),
    GateDef("greedy_agreement_min", "greedy_agreement", ">=", "",
            "mean common-prefix share of greedy answers to chat prompts against the baseline's"),
    GateDef("chat_top1_agreement_min", "chat_top1_agreement", ">=", "",
            "share of the baseline's answer tokens to chat prompts whose top-1 prediction matches the baseline's"),
    GateDef("chat_mean_kld_max", "chat_mean_kld", "<=", "",
            "mean KL divergence from the baseline's next-token distributions over its answers to chat prompts"),
)}


@dataclass
class GateResult:
    name: str
    metric: str
    threshold: float | None
    value: float | None
    op: str
    passed: bool | None  # None: not configured (skipped)
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    return f"{x:.4g}{unit}"


def evaluate_gates(thresholds: dict, evaluation: dict) -> list[GateResult]:
    """One result per known gate; unset thresholds are skipped, a missing measurement fails."""
    comparison = evaluation.get("comparison")
    out = []
    for name, g in GATES.items():
        threshold = thresholds.get(name)
        if threshold is None:
            out.append(GateResult(name, g.metric, None, (comparison or {}).get(g.metric), g.op, None,
                                  f"{name}: not set"))
            continue
        threshold = float(threshold)
        value = (comparison or {}).get(g.metric)
        if value is None:
            why = "no baseline to compare against" if comparison is None else f"{g.metric} was not measured"
            out.append(GateResult(name, g.metric, threshold, None, g.op, False,
                                  f"gate {name} FAILED: {why} (threshold {g.op} {_fmt(threshold, g.unit)})"))
            continue
        value = float(value)
        ok = not math.isnan(value) and (value <= threshold if g.op == "<=" else value >= threshold)
        verdict = "passed" if ok else "FAILED"
        msg = (f"gate {name} {verdict}: {g.metric} = {_fmt(value, g.unit)}, threshold {g.op} {_fmt(threshold, g.unit)}")
        if name == "ppl_increase_pct" and evaluation.get("baseline_perplexity"):
            msg += (f" (perplexity {evaluation['perplexity']['ppl']:.4f} vs baseline "
                    f"{evaluation['baseline_perplexity']['ppl']:.4f})")
        out.append(GateResult(name, g.metric, threshold, value, g.op, ok, msg))
    return out


def failed(results: list[GateResult]) -> list[GateResult]:
    return [r for r in results if r.passed is False]


def failure_message(results: list[GateResult]) -> str:
    bad = failed(results)
    return f"{len(bad)} accuracy gate(s) failed: " + "; ".join(r.message.removeprefix("gate ") for r in bad)


def junit_xml(results: list[GateResult], suite: str = "infer-eval gates", artifact: str = "") -> str:
    """JUnit XML with one test case per gate: failures for failed gates, skipped for unset ones."""
    n_fail = len(failed(results))
    n_skip = sum(r.passed is None for r in results)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f'<testsuites name={quoteattr(suite)} tests="{len(results)}" failures="{n_fail}" skipped="{n_skip}">',
             f'  <testsuite name={quoteattr(suite)} tests="{len(results)}" failures="{n_fail}" errors="0" '
             f'skipped="{n_skip}">']
    if artifact:
        lines.append(f'    <properties><property name="artifact" value={quoteattr(artifact)}/></properties>')
    for r in results:
        head = f'    <testcase classname="infer.gates" name={quoteattr(r.name)}'
        out = (f"{r.metric}={r.value!r} threshold {r.op} {r.threshold!r}")
        if r.passed is None:
            lines += [head + ">", f"      <skipped message={quoteattr(r.message)}/>", "    </testcase>"]
        elif r.passed:
            lines += [head + ">", f"      <system-out>{escape(out)}</system-out>", "    </testcase>"]
        else:
            lines += [head + ">", f'      <failure message={quoteattr(r.message)} type="GateFailed">{escape(out)}</failure>',
                      "    </testcase>"]
    lines += ["  </testsuite>", "</testsuites>", ""]
    return "\n".join(lines)


def write_junit(path: str | Path, results: list[GateResult], artifact: str = "") -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(junit_xml(results, artifact=artifact), encoding="utf-8")
    return path
