"""The tune stage: the packaged artifact plus ``tuning.json``, the runtime's kernel choices per
batch-size bucket measured on this machine (runtime/tuning_measure.py says what is timed and the rule).
Where a CUDA GPU is present the measurement also captures the decode CUDA graphs once as a check
(tuning.json's ``gpu`` section); without one it records nothing about graphs.

The measurement (stage ``tune-measure``) is cached by the model files and the hardware, so a rebuild
on the same machine, or another recipe of the same model, reuses the table; a build elsewhere measures anew, and its artifact differs only in tuning.json and
the manifest that lists its hash (the model files are hard links of the package's, byte-identical).
``tune.table=FILE`` copies a given table instead of measuring: the whole artifact is then
byte-identical from build to build and machine to machine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from infer.runtime.artifact import MANIFEST, TUNING, sha256_file, write_manifest
from infer.runtime.tuning import Tuning, TuningError, hardware, write
from infer.runtime.tuning_measure import measure

from .config import BuildConfig
from .stage import StageResult, content_key, link_tree, run_stage

log = logging.getLogger("infer.build")
TUNE_VERSION = 2  # 2: decode attention also times the paged kernel's float path (cpp-float)


class TuneError(ValueError):
    """A tune setting that cannot work; the message names the key and the fix."""


def wanted(cfg: BuildConfig) -> bool:
    """Tuning runs unless disabled; a tensor-parallel artifact is not tuned yet (its ranks run their
    own slices, which the table's single-process timings would not describe)."""
    if cfg.tune.table and not cfg.tune.enabled:
        raise TuneError("tune.table is set but tune.enabled=false: enable the stage, or drop the table")
    return cfg.tune.enabled and getattr(getattr(cfg, "parallel", None), "tp", 1) == 1


def tune_stage(cfg: BuildConfig, cache: Path, packaged: StageResult) -> StageResult:
    """Measures (or copies ``tune.table``) and seals the tuned artifact as a cached stage.

    The measurement is a stage of its own, keyed by the model files and the hardware, so recipes that
    differ only in what the manifest records (names, gates) share one table, and their evaluation."""
    given = Path(cfg.tune.table).expanduser() if cfg.tune.table else None
    if given is not None:
        try:
            Tuning.load(given)
        except TuningError as e:
            raise TuneError(f"tune.table: {e}") from None
        source = "tune.table"
    else:
        files = json.loads((packaged.path / MANIFEST).read_text())["files"]
        model = {k: v["sha256"] for k, v in files.items()}
        measure_inputs = {"v": TUNE_VERSION, "model": model, "hardware": hardware(),
                          "buckets": sorted(set(cfg.tune.batch_buckets))}
        measured = run_stage(cache, "tune-measure", measure_inputs,
                             lambda out: _measure(packaged.path, out, cfg.tune.batch_buckets))
        given, source = measured.path / TUNING, "measured"
    inputs = {"v": TUNE_VERSION, "package": packaged.key, "table_sha256": sha256_file(given), "source": source}
    key = content_key("tune", inputs)
    return run_stage(cache, "tune", inputs, lambda out: _tuned(packaged.path, out, given, source, key))


def _measure(packaged: Path, out: Path, buckets: list[int]) -> dict:
    table = measure(packaged, buckets)
    write(table, out / TUNING)
    log.info("tune: measured in %.1fs on %s", table["seconds"], table["hardware"]["cpu"])
    graphs = table.get("gpu", {}).get("cuda_graphs")  # only where a CUDA GPU is present (runtime/tuning_measure.gpu_check)
    if graphs is not None:
        log.info("tune: on %s, %s", table["gpu"]["device"],
                 f"CUDA graphs of decode buckets {graphs['buckets']} captured and replayed" if graphs["validated"]
                 else f"CUDA graphs not checked: {graphs['why']}")
    return {"seconds": table["seconds"]}


def _tuned(packaged: Path, out: Path, given: Path, source: str, key: str) -> dict:
    link_tree(packaged, out)
    table = json.loads(given.read_text())
    write(table, out / TUNING)
    changed = Tuning(table).changed()
    for line in changed:
        log.info("tune: %s", line)
    manifest = json.loads((packaged / MANIFEST).read_text())
    for k in ("files", "format", "format_version"):
        manifest.pop(k, None)
    manifest["stages"] = {**manifest.get("stages", {}), "tune": key}
    manifest["tuning"] = {"file": TUNING, "source": source,
                          "hardware": table["hardware"], "changed": changed}
    sealed = write_manifest(out, manifest, linked_from=packaged)
    return {"files": len(sealed["files"]), "changed": changed}
