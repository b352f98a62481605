"""A build: the recipe's stages run in order, each cached, then the artifact is published."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from infer.runtime.artifact import CONFIG, FORMAT_VERSION
from infer.runtime.model.families import UnsupportedConfig, check_config

from . import gate, kv_cache, tune
from .config import BuildConfig, QuantMethod, to_plain
from .merge import PER_RANK_KINDS, MergeError, merge
from .package import build_environment, package, publish
from .shard import ShardError, check_tp, shard
from .sources import load_checkpoint, resolve_source
from .stage import BuildError, StageResult, run_stage

log = logging.getLogger("infer.build")

# Bump a stage's version when its code changes what it writes: old cache entries then stop matching.
STAGE_VERSIONS = {"load": 1, "quantize": 1, "package": 1, "merge": 1, "shard": 1}


@dataclass
class BuildResult:
    artifact: Path
    stages: list[StageResult] = field(default_factory=list)
    evaluation: dict | None = None  # eval.json's content when the gate stages ran


def recipe_record(cfg: BuildConfig) -> dict:
    """The recipe as it shapes the artifact: where it is written and cached does not."""
    plain = to_plain(cfg)
    plain.pop("output_dir")
    plain.pop("cache_dir")
    plain["eval"].pop("junit", None)  # where a CI job wants its JUnit file, not what the artifact is
    plain["tune"].pop("table", None)  # where a reused table lies; its hash is in the tune stage's record
    return plain


def check_supported(cfg: BuildConfig) -> None:
    """Fails before any work for what this build cannot do."""
    if cfg.quant.method != QuantMethod.none:
        try:
            import llmcompressor  # noqa: F401  - the quantize stage's algorithms
        except ImportError as e:
            raise BuildError(f"quant.method={cfg.quant.method.value}: llm-compressor is not installed ({e}); "
                             f"pip install llmcompressor==0.14.0.1, or use quant=none") from None


def check_model(directory: Path, cfg: BuildConfig | None = None) -> None:
    """The runtime's own check of a checkpoint's family and keys (runtime/model/families.py), so that
    nothing is built that infer-run would refuse; given the recipe, also whether its parallel.tp and
    quantization scheme take this family (the checks the shard and quantize stages make again after the
    load stage, for sources without a config.json yet). TensorRT-LLM's config.json is checked once merged."""
    path = Path(directory).expanduser() / CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if "mapping" in config and "model_type" not in config:
        return
    try:
        check_config(config)
    except UnsupportedConfig as e:
        raise BuildError(f"{path.parent}: {e}. infer-run could not serve this model, so nothing was built") from None
    if cfg is None:
        return
    from .quantize import QuantError, plan

    q = cfg.quant
    try:
        check_tp(config, cfg.parallel.tp, q.group_size if q.method != QuantMethod.none and q.group_size != -1 else None)
        if q.method != QuantMethod.none:
            plan(cfg, config)
    except (ShardError, QuantError) as e:
        raise BuildError(f"{path.parent}: {e}") from None


def check_shardable(cfg: BuildConfig, loaded: StageResult) -> None:
    """parallel.tp's constraints (whole heads, whole quantization groups), before any quantization."""
    q = cfg.quant
    group = q.group_size if q.method != QuantMethod.none and q.group_size != -1 else None
    try:
        check_tp(json.loads((loaded.path / CONFIG).read_text()), cfg.parallel.tp, group)
    except ShardError as e:
        raise BuildError(str(e)) from None


def shard_stage(cache: Path, checkpoint: StageResult, tp: int) -> StageResult:
    """The checkpoint (quantized or not) split into tp rank files: pipeline/shard.py's layout."""
    try:
        return run_stage(cache, "shard", {"v": STAGE_VERSIONS["shard"], "checkpoint": checkpoint.key, "tp": tp},
                         lambda out: shard(checkpoint.path, out, tp))
    except ShardError as e:
        raise BuildError(str(e)) from None


def quantize_stage(cfg: BuildConfig, cache: Path, loaded: StageResult, env: dict) -> tuple[StageResult, dict]:
    """Plans the scheme and the calibration data (every check before calibration), then runs the stage."""
    from .quantize import QuantError, calibration_windows, plan, quantize

    try:
        qplan = plan(cfg, json.loads((loaded.path / CONFIG).read_text()))
        windows, calib = calibration_windows(cfg, loaded.path) if qplan.needs_calibration else ([], None)
    except QuantError as e:
        raise BuildError(str(e)) from None
    record = {**qplan.record(), "calibration": calib}
    inputs = {"v": STAGE_VERSIONS["quantize"], "checkpoint": loaded.key, "plan": record,
              "dampening_frac": cfg.quant.dampening_frac, "smoothing_strength": cfg.quant.smoothing_strength,
              "packages": env["packages"]}
    result = run_stage(cache, "quantize", inputs, lambda out: quantize(loaded.path, out, cfg, qplan, windows))
    return result, record


def build(cfg: BuildConfig, publish_artifact: bool = True) -> BuildResult:
    """Runs the stages and publishes to cfg.output_dir; with publish_artifact=False, returns the
    packaged stage directory instead (used for the gates' unquantized baseline), with no gates."""
    check_supported(cfg)
    chooses = publish_artifact and gate.chooses(cfg)
    # a local checkpoint: before its files are even hashed (the scheme per candidate, in its own build)
    check_model(Path(cfg.model.source), None if chooses else cfg)
    if chooses:  # candidates chosen by the gates: each one an ordinary build
        return gate.choose_and_build(cfg, build)
    cache = Path(cfg.cache_dir).expanduser()
    source = resolve_source(cfg.model.source, cfg.model.revision, cache)
    if source.kind == "hub":
        check_model(source.path)
    log.info("source %s (%s, sha256 %s)", source.uri, source.kind, source.sha256[:12])
    dtype = cfg.model.dtype.value
    stages, readable, load_inputs = [], source, {"v": STAGE_VERSIONS["load"], "source": source.identity(), "dtype": dtype}
    if source.kind in PER_RANK_KINDS:  # rank files (ours, TensorRT-LLM's) become one HF checkpoint first
        try:
            merged = run_stage(cache, "merge", {"v": STAGE_VERSIONS["merge"], "source": source.identity()},
                               lambda out: merge(source.path, out))
        except MergeError as e:
            raise BuildError(str(e)) from None
        stages.append(merged)
        readable, load_inputs = replace(source, kind="hf", path=merged.path), {**load_inputs, "merged": merged.key}
    loaded = run_stage(cache, "load", load_inputs, lambda out: load_checkpoint(readable, out, dtype))
    stages.append(loaded)
    check_model(loaded.path)  # every source as the artifact will hold it (GGUF converted, ranks merged)
    checkpoint = loaded
    if cfg.parallel.tp > 1:
        check_shardable(cfg, loaded)
    recipe = recipe_record(cfg)
    env = build_environment()
    quant_record = None
    if cfg.quant.method != QuantMethod.none:
        checkpoint, quant_record = quantize_stage(cfg, cache, loaded, env)
        stages.append(checkpoint)
    if cfg.parallel.tp > 1:  # after quantize: quantized layers split on their group boundaries
        checkpoint = shard_stage(cache, checkpoint, cfg.parallel.tp)
        stages.append(checkpoint)
    manifest = {
        "name": cfg.artifact.name,
        "version": cfg.artifact.version,
        "recipe": recipe,
        "source": source.identity(),
        "build": env,
        "stages": {s.name: s.key for s in stages},
    }
    if quant_record is not None:
        manifest["quantize"] = quant_record  # the scheme and the calibration data's hashes
    if cfg.speculative.method != "off":  # what infer-run serves with unless told otherwise
        manifest["serving"] = {"speculative": asdict(cfg.speculative)}
    packaged = run_stage(cache, "package", {"v": STAGE_VERSIONS["package"], "format": FORMAT_VERSION,
                                            "checkpoint": checkpoint.key, "manifest": manifest},
                         lambda out: package(checkpoint.path, out, manifest))
    stages.append(packaged)
    if not publish_artifact:
        return BuildResult(packaged.path, stages)
    try:
        if tune.wanted(cfg):  # kernel choices per batch bucket, measured here (or tune.table's)
            packaged = tune.tune_stage(cfg, cache, packaged)
            stages.append(packaged)
    except tune.TuneError as e:
        raise BuildError(str(e)) from None
    if kv_cache.wanted(cfg):  # the KV cache format, gated on long windows (manifest kv_cache)
        try:
            packaged = kv_cache.kv_stage(cfg, cache, packaged)
        except kv_cache.KVCacheError as e:
            raise BuildError(str(e)) from None
        stages.append(packaged)
    final, evaluation = packaged, None
    if gate.wanted(cfg):  # gates before publish: a failure raises gate.GateFailed and nothing is published
        final, evaluation, extra = gate.run(cfg, cache, stages, packaged, recipe,
                                            lambda c: build(c, publish_artifact=False))
        stages += extra
    artifact = publish(final.path, Path(cfg.output_dir))
    log.info("artifact %s %s -> %s", cfg.artifact.name, cfg.artifact.version, artifact)
    log.info("build report -> %s", write_report(artifact, stages))
    return BuildResult(artifact, stages, evaluation)


def report_path(artifact: Path) -> Path:
    """Where a build's report goes: beside the artifact directory, not in it (the manifest lists every file an
    artifact holds, and the same recipe must give the same bytes; times and memory differ run to run)."""
    return artifact.with_name(artifact.name + ".build-report.json")


def write_report(artifact: Path, stages: list[StageResult]) -> Path:
    """Each stage's wall time and peak anonymous memory (stage.PeakMemory) in this run, cached ones marked."""
    rows = [{"stage": s.name, "key": s.key[:12], "cached": s.cached, "seconds": s.seconds,
             "peak_anon_gib": None if s.peak_anon_bytes is None else round(s.peak_anon_bytes / 2**30, 3)}
            for s in stages]
    path = report_path(artifact)
    path.write_text(json.dumps({"artifact": str(artifact), "cpus": os.cpu_count(), "stages": rows}, indent=2) + "\n")
    return path
