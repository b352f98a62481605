"""A build: the recipe's stages run in order, each cached, then the artifact is published."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from infer.runtime.artifact import FORMAT_VERSION

from . import gate
from .config import BuildConfig, QuantMethod, to_plain
from .package import build_environment, package, publish
from .sources import load_checkpoint, resolve_source
from .stage import StageResult, run_stage

log = logging.getLogger("infer.build")

# Bump a stage's version when its code changes what it writes: old cache entries then stop matching.
STAGE_VERSIONS = {"load": 1, "quantize": 1, "package": 1}


class BuildError(Exception):
    """A build that cannot go on; the message says why and what to do."""


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
    return plain


def check_supported(cfg: BuildConfig) -> None:
    """Fails before any work for what this build cannot do."""
    if cfg.quant.method != QuantMethod.none:
        try:
            import llmcompressor  # noqa: F401  - the quantize stage's algorithms
        except ImportError as e:
            raise BuildError(f"quant.method={cfg.quant.method.value}: llm-compressor is not installed ({e}); "
                             f"pip install llmcompressor==0.14.0.1, or use quant=none") from None


def quantize_stage(cfg: BuildConfig, cache: Path, loaded: StageResult, env: dict) -> tuple[StageResult, dict]:
    """Plans the scheme and the calibration data (every check before calibration), then runs the stage."""
    from .quantize import QuantError, calibration_windows, plan, quantize

    try:
        qplan = plan(cfg, json.loads((loaded.path / "config.json").read_text()))
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
    cache = Path(cfg.cache_dir).expanduser()
    source = resolve_source(cfg.model.source, cfg.model.revision, cache)
    log.info("source %s (%s, sha256 %s)", source.uri, source.kind, source.sha256[:12])
    dtype = cfg.model.dtype.value
    loaded = run_stage(cache, "load", {"v": STAGE_VERSIONS["load"], "source": source.identity(), "dtype": dtype},
                       lambda out: load_checkpoint(source, out, dtype))
    stages = [loaded]
    checkpoint = loaded
    recipe = recipe_record(cfg)
    env = build_environment()
    quant_record = None
    if cfg.quant.method != QuantMethod.none:
        checkpoint, quant_record = quantize_stage(cfg, cache, loaded, env)
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
    packaged = run_stage(cache, "package", {"v": STAGE_VERSIONS["package"], "format": FORMAT_VERSION,
                                            "checkpoint": checkpoint.key, "manifest": manifest},
                         lambda out: package(checkpoint.path, out, manifest))
    stages.append(packaged)
    if not publish_artifact:
        return BuildResult(packaged.path, stages)
    final, evaluation = packaged, None
    if gate.wanted(cfg):  # gates before publish: a failure raises gate.GateFailed and nothing is published
        final, evaluation, extra = gate.run(cfg, cache, stages, packaged, recipe,
                                            lambda c: build(c, publish_artifact=False))
        stages += extra
    artifact = publish(final.path, Path(cfg.output_dir))
    log.info("artifact %s %s -> %s", cfg.artifact.name, cfg.artifact.version, artifact)
    return BuildResult(artifact, stages, evaluation)
