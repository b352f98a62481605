"""The gate stages: evaluate the packaged artifact against its baseline, decide, report, seal.

After ``package`` and before ``publish``, when the recipe's ``eval`` section asks for it:

1. the baseline is resolved: by default the same recipe with ``quant.method=none`` (its own
   cached load and package stages; the artifact itself when it is already unquantized at the
   baseline's dtype), or an artifact directory, or none;
2. ``eval`` (cached by the model files' hashes, the baseline's, the data and the settings, not
   the thresholds): every metric of ``infer.eval.metrics.evaluate``;
3. the gates are checked; a JUnit file is written if ``eval.junit`` names one;
4. a failing gate raises ``GateFailed`` (exit code 3): nothing is published, and the report goes
   to ``<output_dir>.gate-failed/`` (no model files, no manifest: never mistakable for an artifact);
5. otherwise ``gate`` seals a new artifact directory: the package's files (hard links), plus
   ``eval.json``, ``report.md``, ``report.html`` and ``plots/``, all listed in a new manifest.

A recipe may leave a choice to the gates (``choose_and_build``): ``quant.smoothing_strength`` as a
list of candidates (w8a8), or ``quant.auto=true`` (accuracy-gated mixed precision: gptq/awq widen layers to
int8, fp8/w8a8 keep them in float). Each
candidate is an ordinary build of its own settings (its stages cached like any other); they are
built and gated in turn and the first that passes every gate is published, with every candidate
tried, its metrics and its size in ``eval.json``, the report and the manifest (``selection``).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from infer.runtime.artifact import MANIFEST, dump_json, verify_artifact, write_manifest

from .config import BuildConfig, QuantMethod, baseline_config, baseline_dtype, to_plain
from .stage import StageResult, artifact_view, content_key, link_tree, run_stage

log = logging.getLogger("infer.build")
GATE_VERSION = 1
EVAL_FILES = ("eval.json", "report.md", "report.html")


class EvaluationError(Exception):
    """The evaluation could not run (bad data, prompts or baseline): a build error, not a gate verdict."""


class GateFailed(Exception):
    """One or more accuracy gates failed: the message names each gate, its value and threshold."""

    def __init__(self, message: str, doc: dict, report_dir: Path | None, junit: Path | None):
        super().__init__(message)
        self.doc, self.report_dir, self.junit = doc, report_dir, junit


def wanted(cfg: BuildConfig) -> bool:
    """Evaluation runs when enabled, or when any gate or lm-eval task is set."""
    e = cfg.eval
    return e.enabled or bool(e.tasks) or any(v is not None for v in asdict(e.gates).values())


def is_own_baseline(cfg: BuildConfig) -> bool:
    return cfg.quant.method == QuantMethod.none and baseline_dtype(cfg) == cfg.model.dtype


def _stage_row(s: StageResult, role: str) -> dict:
    return {"name": s.name, "role": role, "key": s.key, "seconds": s.seconds, "cached": s.cached}


def _layer_errors(stages: list[StageResult]):
    for s in stages:
        if s.name == "quantize":
            for k in ("layer_errors", "per_layer_error", "layer_error"):
                if s.info.get(k):
                    return s.info[k]
    return None


def write_eval_files(out: Path, doc: dict) -> None:
    from infer.eval.report import write_report

    write_report(out, doc)
    dump_json(doc, out / "eval.json")


# ---------------------------------------------------------------------------- choosing between candidates

_SELECTION: dict | None = None  # set by choose_and_build while a candidate builds: its doc records it
CANDIDATE_METRICS = ("ppl_increase_pct", "mean_kld", "top1_agreement", "greedy_agreement", "chat_mean_kld",
                     "chat_top1_agreement")


def chooses(cfg: BuildConfig) -> bool:
    """Whether the recipe leaves a choice to the gates (several smoothing strengths, or quant.auto)."""
    from .quantize import smoothing_candidates

    q = cfg.quant
    # quant.auto on method none is a choice too: choose_and_build refuses it, naming the fix
    return q.auto or (q.method != QuantMethod.none and len(smoothing_candidates(cfg)) > 1)


def candidate_row(label: str, settings: dict, doc: dict, size_bytes: int | None = None) -> dict:
    comp = (doc.get("evaluation") or {}).get("comparison") or {}
    return {"candidate": label, "settings": settings, "passed": doc.get("passed"),
            "perplexity": ((doc.get("evaluation") or {}).get("perplexity") or {}).get("ppl"),
            **{k: comp.get(k) for k in CANDIDATE_METRICS},
            "gates": {g["name"]: g["passed"] for g in doc.get("gates", []) if g["passed"] is not None},
            "size_bytes": size_bytes}


def _package_size(path: Path) -> int:
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    return sum(f["size"] for k, f in manifest.get("files", {}).items() if k.endswith(".safetensors"))


def _smoothing_steps(cfg: BuildConfig):
    from .quantize import smoothing_candidates

    for a in smoothing_candidates(cfg):
        label = "no SmoothQuant" if a == 0 else f"SmoothQuant {a:g}"
        yield label, {"quant.smoothing_strength": a}, replace(cfg, quant=replace(cfg.quant, smoothing_strength=a))


def choose_and_build(cfg: BuildConfig, build):
    """Builds and gates each candidate in turn; publishes the first that passes every gate.

    ``build``: pipeline.build.build. Raises GateFailed (exit 3) naming every candidate when none passes."""
    from .stage import BuildError

    global _SELECTION
    from .quantize import FLOAT_WIDENED, auto_problem

    problem = auto_problem(cfg)
    if problem:
        raise BuildError(problem)
    if not wanted(cfg) or all(v is None for v in asdict(cfg.eval.gates).values()):
        key = "quant.auto=true" if cfg.quant.auto else f"quant.smoothing_strength={cfg.quant.smoothing_strength}"
        raise BuildError(f"{key}: the candidates are chosen by the eval gates, and none is set; add eval=release "
                         f"or eval.gates.* thresholds")
    if cfg.quant.auto:
        from .quantize import auto_steps

        if cfg.quant.method.value in FLOAT_WIDENED:
            key, rule = "quant.ignore", ("plain first, then the most sensitive layers kept in float (added to "
                                         "quant.ignore) until the gates pass or the size budget "
                                         f"(+{cfg.quant.size_budget_pct:g}%) is spent")
        else:
            key, rule = "quant.wide_layers", ("plain first, then the most sensitive layers widened to "
                                              f"{cfg.quant.wide_bits} bits until the gates pass or the size budget "
                                              f"(+{cfg.quant.size_budget_pct:g}%) is spent")
        record = {"key": key, "rule": rule, "candidates": []}
        steps = auto_steps(cfg, record, lambda c: build(c, publish_artifact=False))
    else:
        record = {"key": "quant.smoothing_strength", "rule": "the first candidate, in the recipe's order, whose "
                                                            "gates all pass", "candidates": []}
        steps = _smoothing_steps(cfg)
    last = None
    for label, settings, c in steps:
        log.info("candidate %s (%s)", label, ", ".join(f"{k}={v}" for k, v in settings.items()))
        _SELECTION = {**record, "trying": {"candidate": label, "settings": settings}}
        try:
            return build(c)
        except GateFailed as e:
            size = _package_size(build(c, publish_artifact=False).artifact)
            record["candidates"].append(candidate_row(label, settings, e.doc, size))
            last = e
            log.warning("candidate %s failed its gates: %s", label, e)
        finally:
            _SELECTION = None
    if last is None:
        raise BuildError(f"{record['key']}: no candidate to build")
    names = "; ".join(f"{r['candidate']}: " + ", ".join(g for g, ok in r["gates"].items() if not ok)
                      for r in record["candidates"])
    doc = {**last.doc, "selection": {**record, "chosen": None}}
    if last.report_dir is not None:
        write_eval_files(last.report_dir, doc)
    raise GateFailed(f"no candidate of {record['key']} passed its gates ({names}); the last: {last}", doc,
                     last.report_dir, last.junit)


def _selection_doc(doc: dict, packaged: Path) -> dict | None:
    """This build's selection record, when choose_and_build is building it as a candidate."""
    if _SELECTION is None:
        return None
    trying = _SELECTION["trying"]
    row = candidate_row(trying["candidate"], trying["settings"], doc, _package_size(packaged))
    extra = {k: v for k, v in _SELECTION.items() if k not in ("candidates", "trying")}
    return {**extra, "chosen": trying["candidate"] if doc["passed"] else None,
            "candidates": [*_SELECTION["candidates"], row]}


def _seal(packaged: Path, out: Path, doc: dict, stage_keys: dict) -> dict:
    link_tree(packaged, out)
    write_eval_files(out, doc)
    manifest = json.loads((packaged / MANIFEST).read_text())
    for k in ("files", "format", "format_version"):
        manifest.pop(k, None)
    manifest["stages"] = {**manifest.get("stages", {}), **stage_keys}
    manifest["evaluation"] = {
        "passed": doc["passed"], "report": "report.md", "results": "eval.json",
        "perplexity": doc["evaluation"]["perplexity"]["ppl"],
        "gates": {g["name"]: {"value": g["value"], "threshold": g["threshold"], "passed": g["passed"]}
                  for g in doc["gates"] if g["passed"] is not None},
    }
    if doc.get("selection"):
        sel = doc["selection"]
        manifest["evaluation"]["selection"] = {
            "key": sel["key"], "rule": sel["rule"], "chosen": sel["chosen"],
            "candidates": [{k: r[k] for k in ("candidate", "settings", "passed", "size_bytes", *CANDIDATE_METRICS)}
                           for r in sel["candidates"]]}
        for k in ("sensitivity", "widening_cost_bytes", "plain_size_bytes", "budget_bytes", "wide_format"):
            if k in sel:
                manifest["evaluation"]["selection"][k] = sel[k]
    sealed = write_manifest(out, manifest, linked_from=packaged)
    return {"files": len(sealed["files"]), "passed": doc["passed"]}


def run(cfg: BuildConfig, cache: Path, stages: list[StageResult], packaged: StageResult, recipe: dict,
        build_unpublished) -> tuple[StageResult, dict, list[StageResult]]:
    """Evaluates, gates and seals; returns the sealed stage, the eval document and the extra stages."""
    from infer.eval.settings import EvalError

    try:
        return _run(cfg, cache, stages, packaged, recipe, build_unpublished)
    except EvalError as err:  # DataError is a ValueError too, raised as EvalError by eval_texts
        raise EvaluationError(f"evaluation: {err}") from None


def _run(cfg, cache, stages, packaged, recipe, build_unpublished):
    from infer.eval.gates import evaluate_gates, failed, failure_message, write_junit
    from infer.eval.metrics import (EVAL_VERSION, artifact_summary, eval_texts, evaluate, load_prompts,
                                    model_identity, texts_digest)
    from infer.eval.settings import EvalSettings

    e = cfg.eval
    settings = EvalSettings.from_spec(e)
    settings.check()
    output_dir = Path(cfg.output_dir).expanduser().absolute()
    manifest = json.loads((packaged.path / MANIFEST).read_text())
    extra: list[StageResult] = []
    base_rows: list[dict] = []
    if e.baseline == "none":
        baseline, base_id = None, None
    elif e.baseline == "unquantized" and is_own_baseline(cfg):
        baseline, base_id = packaged.path, "self"
        log.info("baseline: the artifact itself (unquantized, %s)", cfg.model.dtype.value)
    elif e.baseline == "unquantized":
        log.info("baseline: this recipe with quant.method=none, %s", baseline_dtype(cfg).value)
        built = build_unpublished(baseline_config(cfg))
        baseline = built.artifact
        base_rows = [_stage_row(s, "baseline") for s in built.stages]
        base_id = model_identity(json.loads((baseline / MANIFEST).read_text()))
    else:
        baseline = verify_artifact(Path(e.baseline).expanduser()).path
        base_id = model_identity(json.loads((baseline / MANIFEST).read_text()))
    texts = eval_texts(settings.data)
    prompts = load_prompts(settings.prompts, settings.max_prompts) if baseline is not None else []
    inputs = {"v": EVAL_VERSION, "model": model_identity(manifest), "baseline": base_id,
              "settings": asdict(settings), "data": texts_digest(texts), "prompts": prompts}

    def measure(out: Path) -> dict:
        with artifact_view(packaged.path, out / ".artifact") as view:
            if baseline is None or base_id == "self":
                result = evaluate(view, view if baseline is not None else None, settings, log=log.info)
            else:
                with artifact_view(baseline, out / ".baseline") as base_view:
                    result = evaluate(view, base_view, settings, log=log.info)
        dump_json(result, out / "metrics.json")
        return {"ppl": result["perplexity"]["ppl"], **{k: v for k, v in (result.get("comparison") or {}).items()
                                                        if k in ("mean_kld", "top1_agreement", "ppl_increase_pct")}}

    evaluated = run_stage(cache, "eval", inputs, measure)
    extra.append(evaluated)
    evaluation = json.loads((evaluated.path / "metrics.json").read_text())
    evaluation["artifact"] = {**artifact_summary(output_dir, manifest)}
    if baseline is not None and base_id != "self":
        evaluation["baseline"] = artifact_summary(baseline, json.loads((baseline / MANIFEST).read_text()))
    thresholds = asdict(e.gates)
    gates = evaluate_gates(thresholds, evaluation)
    passed = not failed(gates)
    plain = to_plain(cfg)
    doc = {
        "format": "infer-eval", "format_version": 1, "passed": passed,
        "gates": [g.as_dict() for g in gates], "evaluation": evaluation, "recipe": recipe,
        "stages": [_stage_row(s, "artifact") for s in stages] + base_rows + [_stage_row(evaluated, "evaluation")],
        "quantization": {"settings": plain["quant"], "artifact": manifest.get("quantization"),
                         "layer_errors": _layer_errors(stages)},
    }
    selection = _selection_doc(doc, packaged.path)
    if selection is not None:
        doc["selection"] = selection
    for g in gates:
        if g.passed is not None:
            (log.info if g.passed else log.error)("%s", g.message)
    junit = write_junit(e.junit, gates, artifact=str(output_dir)) if e.junit else None
    if junit:
        log.info("JUnit results: %s", junit)
    failed_dir = output_dir.with_name(output_dir.name + ".gate-failed")
    if not passed:
        shutil.rmtree(failed_dir, ignore_errors=True)
        failed_dir.mkdir(parents=True)
        write_eval_files(failed_dir, doc)
        raise GateFailed(f"{failure_message(gates)}. Nothing was published to {output_dir}; "
                         f"the evaluation report is {failed_dir / 'report.md'}", doc, failed_dir, junit)
    if failed_dir.is_dir() and (failed_dir / "eval.json").is_file() and not (failed_dir / MANIFEST).exists():
        shutil.rmtree(failed_dir)  # a stale report of an earlier, failed build of this output
    gate_inputs = {"v": GATE_VERSION, "package": packaged.key, "eval": evaluated.key, "gates": thresholds,
                   **({"selection": doc["selection"]} if doc.get("selection") else {})}
    keys = {"eval": evaluated.key, "gate": content_key("gate", gate_inputs)}
    sealed = run_stage(cache, "gate", gate_inputs, lambda out: _seal(packaged.path, out, doc, keys))
    extra.append(sealed)
    doc = json.loads((sealed.path / "eval.json").read_text())
    return sealed, doc, extra


# ---------------------------------------------------------------------------- multirun sweeps

def record_sweep_variant(doc: dict | None, artifact: Path | None) -> Path | None:
    """Under ``infer-build -m``: adds this job's results to the sweep's one comparison report."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN or doc is None:
            return None
        sweep = Path(hc.sweep.dir)
        num = int(hc.job.num)
    except Exception:  # not under Hydra (the Python API): nothing to record
        return None
    from infer.eval.report import write_comparison

    variants = sweep / "variants"
    variants.mkdir(parents=True, exist_ok=True)
    dump_json({**doc, "artifact_path": str(artifact) if artifact else None}, variants / f"{num:04d}.json")
    docs = [json.loads(p.read_text()) for p in sorted(variants.glob("*.json"))]
    paths = write_comparison(sweep, docs)
    log.info("sweep comparison over %d variant(s): %s", len(docs), paths[0])
    return paths[0]
