"""The build report (report.md, report.html, plots/*.png) and the sweep comparison report.

Both are written from the evaluation document (the content of ``eval.json``): the recipe, the
stage timings, the quantization settings, every metric, every gate with value / threshold /
verdict, and, when the quantize stage recorded them, per-layer quantization errors.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

PLOTS = "plots"

_METRICS = (  # (label, path into the evaluation, higher is better)
    ("perplexity", ("perplexity", "ppl"), False),
    ("mean KLD", ("comparison", "mean_kld"), False),
    ("top-1 agreement", ("comparison", "top1_agreement"), True),
    ("greedy agreement (chat)", ("comparison", "greedy_agreement"), True),
    ("mean KLD (chat)", ("comparison", "chat_mean_kld"), False),
    ("top-1 agreement (chat)", ("comparison", "chat_top1_agreement"), True),
)


def _get(d: dict | None, path: tuple[str, ...]):
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _num(x, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:.3e}"
    return str(x)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=90, metadata={"Software": None})  # no version/time: same bytes each time
    _plt().close(fig)


def layer_errors_of(doc: dict) -> dict[str, float]:
    """Per-layer quantization errors, as the quantize stage recorded them (any of a few shapes)."""
    raw = _get(doc, ("quantization", "layer_errors"))
    if isinstance(raw, dict):
        return {str(k): float(v if not isinstance(v, dict) else v.get("error", v.get("mse", 0.0)))
                for k, v in raw.items() if isinstance(v, (int, float, dict))}
    if isinstance(raw, list):
        out = {}
        for i, row in enumerate(raw):
            if isinstance(row, dict):
                name = row.get("name") or row.get("layer") or str(i)
                val = row.get("error", row.get("mse", row.get("value")))
                if isinstance(val, (int, float)):
                    out[str(name)] = float(val)
        return out
    return {}


def plot_metrics(doc: dict, path: Path) -> Path:
    """One panel per metric: the artifact against its baseline."""
    plt = _plt()
    ev = doc.get("evaluation", {})
    has_base = ev.get("comparison") is not None
    fig, axes = plt.subplots(1, len(_METRICS), figsize=(3 * len(_METRICS), 3))
    name = _get(ev, ("artifact", "name")) or "artifact"
    for ax, (label, path_, _) in zip(axes, _METRICS):
        v = _get(ev, path_)
        if label == "perplexity":
            b = _get(ev, ("baseline_perplexity", "ppl"))
        elif label.startswith("mean KLD"):
            b = 0.0 if has_base else None
        else:
            b = 1.0 if has_base else None
        labels, values, colors = [], [], []
        if b is not None:
            labels.append("baseline"), values.append(b), colors.append("#999999")
        if v is not None:
            labels.append("artifact"), values.append(v), colors.append("#1f77b4")
        ax.bar(labels, values, color=colors)
        for i, x in enumerate(values):
            ax.annotate(_num(x), (i, x), ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.suptitle(f"{name} against its baseline", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return path


def plot_layer_errors(errors: dict[str, float], path: Path, title: str = "per-layer quantization error",
                      ylabel: str = "quantization error") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, len(errors) * 0.12), 3.5))
    ax.bar(range(len(errors)), list(errors.values()), color="#d62728")
    ax.set_xlabel("layer (in model order)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(errors) <= 40:
        ax.set_xticks(range(len(errors)), list(errors), rotation=90, fontsize=6)
    fig.tight_layout()
    _save(fig, path)
    return path


# ---------------------------------------------------------------------------- tables

def _gate_rows(doc: dict) -> list[list[str]]:
    rows = []
    for g in doc.get("gates", []):
        verdict = "skipped (not set)" if g["passed"] is None else ("PASS" if g["passed"] else "FAIL")
        rows.append([g["name"], g["metric"], _num(g["value"]),
                     f"{g['op']} {_num(g['threshold'])}" if g["threshold"] is not None else "-", verdict])
    return rows


def _metric_rows(ev: dict) -> list[list[str]]:
    rows = [["perplexity (engine)", _num(_get(ev, ("perplexity", "ppl"))),
             _num(_get(ev, ("baseline_perplexity", "ppl")))]]
    comp = ev.get("comparison") or {}
    for key in ("ppl_increase_pct", "mean_kld", "median_kld", "p90_kld", "p99_kld", "max_kld", "top1_agreement",
                "rms_delta_p", "mean_delta_p", "ln_ppl_ratio", "greedy_agreement", "greedy_exact_match", "prompts",
                "tokens", "chat_mean_kld", "chat_p99_kld", "chat_max_kld", "chat_top1_agreement", "chat_tokens"):
        if key in comp:
            rows.append([key, _num(comp[key]), ""])
    for task, metrics in (ev.get("tasks") or {}).items():
        for m, v in metrics.items():
            rows.append([f"{task} {m}", _num(v), _num(_get(ev, ("baseline_tasks", task, m)))])
    return rows


def _candidate_cells(r: dict) -> list[str]:
    settings = ", ".join(f"{k}={v if not isinstance(v, list) or len(v) <= 4 else f'[{len(v)} layers]'}"
                         for k, v in (r.get("settings") or {}).items())
    size = f"{r['size_bytes'] / 1e6:.1f}" if r.get("size_bytes") else "n/a"
    return [r["candidate"], settings, size, *(_num(r.get(k)) for k in (
        "ppl_increase_pct", "mean_kld", "top1_agreement", "greedy_agreement", "chat_mean_kld", "chat_top1_agreement")),
            "PASS" if r.get("passed") else "FAIL"]


def _stage_rows(doc: dict) -> list[list[str]]:
    return [[s["name"], s.get("role", "artifact"), f"{s['seconds']:.1f}", "cached" if s.get("cached") else "ran",
             s["key"][:12]] for s in doc.get("stages", [])]


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


_CSS = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}"
        "th{background:#f3f3f3}.PASS{color:#080}.FAIL{color:#b00;font-weight:bold}img{max-width:100%}"
        "pre{background:#f6f6f6;padding:1em;overflow:auto}")


def _sections(doc: dict) -> list[tuple[str, str, object]]:
    """(title, kind, content): kind is 'table' (head, rows), 'pre' (text), 'img' (path) or 'p' (text)."""
    ev = doc.get("evaluation", {})
    quant = doc.get("quantization") or {}
    passed = doc.get("passed")
    verdict = "all gates passed" if passed else "GATES FAILED: not published" if passed is False else "no gates"
    out = [("Verdict", "p", verdict)]
    out.append(("Gates", "table", (["gate", "metric", "value", "threshold", "verdict"], _gate_rows(doc))))
    sel = doc.get("selection")
    if sel:
        out.append(("Selection", "p", f"{sel['key']} chosen by the gates ({sel['rule']}): "
                                      f"{sel.get('chosen') or 'no candidate passed'}"))
        out.append(("Candidates", "table", (["candidate", "settings", "size MB", "ppl +%", "mean KLD", "top-1",
                                             "greedy (chat)", "KLD (chat)", "top-1 (chat)", "verdict"],
                                            [_candidate_cells(r) for r in sel["candidates"]])))
    out.append(("Metrics", "table", (["metric", "artifact", "baseline"], _metric_rows(ev))))
    data = ev.get("data") or {}
    out.append(("Evaluation data", "p",
                f"{data.get('data')} (sha256 {str(data.get('digest'))[:12]}), {data.get('windows')} windows of "
                f"{data.get('seq_len')} tokens, stride {data.get('stride')}, {data.get('tokens_scored')} tokens scored; "
                f"baseline: {_get(ev, ('baseline', 'path')) or 'none'}"))
    out.append(("Stages", "table", (["stage", "for", "seconds", "status", "key"], _stage_rows(doc))))
    settings = quant.get("settings")
    out.append(("Quantization", "pre", json.dumps({"settings": settings, "artifact": quant.get("artifact")},
                                                  indent=2, sort_keys=True)))
    for name in doc.get("plots", []):
        out.append((name.split("/")[-1].removesuffix(".png").replace("_", " "), "img", name))
    if doc.get("recipe") is not None:
        out.append(("Recipe", "pre", json.dumps(doc["recipe"], indent=2, sort_keys=True)))
    return out


def write_markdown(doc: dict, title: str, path: Path) -> None:
    lines = [f"# {title}", ""]
    for name, kind, content in _sections(doc):
        lines += [f"## {name}", ""]
        if kind == "table":
            lines.append(_md_table(*content))
        elif kind == "pre":
            lines += ["```", str(content), "```"]
        elif kind == "img":
            lines.append(f"![{name}]({content})")
        else:
            lines.append(str(content))
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def write_html(doc: dict, title: str, path: Path) -> None:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    for name, kind, content in _sections(doc):
        parts.append(f"<h2>{html.escape(name)}</h2>")
        if kind == "table":
            t = _html_table(*content)
            t = t.replace("<td>PASS</td>", "<td class='PASS'>PASS</td>").replace("<td>FAIL</td>", "<td class='FAIL'>FAIL</td>")
            parts.append(t)
        elif kind == "pre":
            parts.append(f"<pre>{html.escape(str(content))}</pre>")
        elif kind == "img":
            parts.append(f"<img src='{html.escape(str(content))}' alt='{html.escape(name)}'>")
        else:
            parts.append(f"<p>{html.escape(str(content))}</p>")
    parts.append("</body></html>\n")
    path.write_text("".join(parts), encoding="utf-8")


def write_report(out_dir: str | Path, doc: dict) -> list[Path]:
    """report.md, report.html and plots/*.png into ``out_dir``; records the plot paths in ``doc``."""
    out = Path(out_dir)
    plots = [plot_metrics(doc, out / PLOTS / "metrics.png")]
    errors = layer_errors_of(doc)
    if errors:
        plots.append(plot_layer_errors(errors, out / PLOTS / "layer_errors.png"))
    hidden = _get(doc, ("evaluation", "comparison", "layer_hidden_error"))
    if hidden:
        plots.append(plot_layer_errors({str(i): v for i, v in enumerate(hidden)}, out / PLOTS / "layer_hidden_error.png",
                                       "per-layer hidden-state error against the baseline (relative L2)",
                                       "relative L2 error"))
    sens = _get(doc, ("selection", "sensitivity"))
    if sens:
        plots.append(plot_layer_errors(sens, out / PLOTS / "sensitivity.png",
                                       "per-linear sensitivity: KL(float || only this linear quantized), per token",
                                       "mean KL divergence"))
    doc["plots"] = [p.relative_to(out).as_posix() for p in plots]
    ev = doc.get("evaluation", {})
    title = f"Build report: {_get(ev, ('artifact', 'name')) or 'artifact'} {_get(ev, ('artifact', 'version')) or ''}".strip()
    write_markdown(doc, title, out / "report.md")
    write_html(doc, title, out / "report.html")
    return [out / "report.md", out / "report.html", *plots]


# ---------------------------------------------------------------------------- sweeps

def variant_label(doc: dict) -> str:
    recipe = doc.get("recipe") or {}
    q = recipe.get("quant") or {}
    dtype = (recipe.get("model") or {}).get("dtype", "")
    if not q or q.get("method") in (None, "none"):
        return f"{dtype or 'unquantized'}"
    return f"{q.get('method')} w{q.get('bits')} g{q.get('group_size')}{'' if q.get('symmetric', True) else ' asym'}"


def _verdict(doc: dict) -> str:
    if not any(g.get("passed") is not None for g in doc.get("gates", [])):
        return "no gates set"
    return "PASS" if doc.get("passed") else "FAIL"


def write_comparison(out_dir: str | Path, docs: list[dict]) -> list[Path]:
    """One report over every variant of a sweep: a table and one panel per metric."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    labels = [f"{i}: {variant_label(d)}" for i, d in enumerate(docs)]
    fig, axes = plt.subplots(1, len(_METRICS), figsize=(3.5 * len(_METRICS), 3.6))
    for ax, (label, path_, _) in zip(axes, _METRICS):
        values = [_get(d.get("evaluation"), path_) for d in docs]
        ax.bar(range(len(docs)), [v if v is not None else 0.0 for v in values], color="#1f77b4")
        if label == "perplexity":
            base = next((_get(d.get("evaluation"), ("baseline_perplexity", "ppl")) for d in docs
                         if _get(d.get("evaluation"), ("baseline_perplexity", "ppl")) is not None), None)
            if base is not None:
                ax.axhline(base, color="#999999", linestyle="--", label="baseline")
                ax.legend(fontsize=7)
        ax.set_xticks(range(len(docs)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    _save(fig, out / PLOTS / "comparison.png")
    head = ["variant", "artifact", "perplexity", "baseline ppl", "ppl +%", "mean KLD", "top-1", "greedy (chat)",
            "KLD (chat)", "top-1 (chat)", "gates"]
    rows = []
    for lab, d in zip(labels, docs):
        ev = d.get("evaluation") or {}
        rows.append([lab, _get(ev, ("artifact", "name")) or "", _num(_get(ev, ("perplexity", "ppl"))),
                     _num(_get(ev, ("baseline_perplexity", "ppl"))), _num(_get(ev, ("comparison", "ppl_increase_pct"))),
                     _num(_get(ev, ("comparison", "mean_kld"))), _num(_get(ev, ("comparison", "top1_agreement"))),
                     _num(_get(ev, ("comparison", "greedy_agreement"))),
                     _num(_get(ev, ("comparison", "chat_mean_kld"))), _num(_get(ev, ("comparison", "chat_top1_agreement"))),
                     _verdict(d)])
    md = ["# Sweep comparison", "", _md_table(head, rows), "", f"![comparison]({PLOTS}/comparison.png)", ""]
    (out / "comparison.md").write_text("\n".join(md), encoding="utf-8")
    (out / "comparison.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>Sweep comparison</title><style>{_CSS}</style>"
        f"</head><body><h1>Sweep comparison</h1>{_html_table(head, rows)}"
        f"<img src='{PLOTS}/comparison.png' alt='comparison'></body></html>\n", encoding="utf-8")
    return [out / "comparison.md", out / "comparison.html", out / PLOTS / "comparison.png"]
