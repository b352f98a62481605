"""The tune stage: the packaged artifact plus ``tuning.json``, the runtime's kernel choices per
batch-size bucket measured on this machine (runtime/tuning.py says what is timed and the rule).

Cached by the package's key and the hardware it measures on, so a rebuild on the same machine
reuses the table; a build elsewhere measures anew, and its artifact differs only in tuning.json and
the manifest that lists its hash (the model files are hard links of the package's, byte-identical).
``tune.table=FILE`` copies a given table instead of measuring: the whole artifact is then
byte-identical from build to build and machine to machine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from infer.runtime.artifact import MANIFEST, sha256_file, write_manifest
from infer.runtime.tuning import FILE, Tuning, TuningError, hardware, measure, write

from .config import BuildConfig
from .stage import StageResult, content_key, link_tree, run_stage

log = logging.getLogger("infer.build")
TUNE_VERSION = 1


class TuneError(ValueError):
    """A tune setting that cannot work; the message names the key and the fix."""


def wanted(cfg: BuildConfig) -> bool:
    """Tuning runs unless disabled; a tensor-parallel artifact is not tuned yet (its ranks run their
    own slices, which the table's single-process timings would not describe)."""
    if cfg.tune.table and not cfg.tune.enabled:
        raise TuneError("tune.table is set but tune.enabled=false: enable the stage, or drop the table")
    return cfg.tune.enabled and getattr(getattr(cfg, "parallel", None), "tp", 1) == 1


def tune_stage(cfg: BuildConfig, cache: Path, packaged: StageResult) -> StageResult:
    """Measures (or copies ``tune.table``) and seals the tuned artifact as a cached stage."""
    given = Path(cfg.tune.table).expanduser() if cfg.tune.table else None
    if given is not None:
        try:
            Tuning.load(given)
        except TuningError as e:
            raise TuneError(f"tune.table: {e}") from None
        source = {"table_sha256": sha256_file(given)}
    else:
        source = {"hardware": hardware(), "buckets": sorted(set(cfg.tune.batch_buckets))}
    inputs = {"v": TUNE_VERSION, "package": packaged.key, **source}
    key = content_key("tune", inputs)
    return run_stage(cache, "tune", inputs, lambda out: _tuned(packaged.path, out, cfg, given, key))


def _tuned(packaged: Path, out: Path, cfg: BuildConfig, given: Path | None, key: str) -> dict:
    link_tree(packaged, out)
    if given is not None:
        table = json.loads(given.read_text())
        write(table, out / FILE)
        log.info("tune: reusing %s", given)
    else:
        table = measure(packaged, cfg.tune.batch_buckets)
        write(table, out / FILE)
        log.info("tune: measured in %.1fs on %s", table["seconds"], table["hardware"]["cpu"])
    changed = Tuning(table).changed()
    for line in changed:
        log.info("tune: %s", line)
    manifest = json.loads((packaged / MANIFEST).read_text())
    for k in ("files", "format", "format_version"):
        manifest.pop(k, None)
    manifest["stages"] = {**manifest.get("stages", {}), "tune": key}
    manifest["tuning"] = {"file": FILE, "source": "tune.table" if given is not None else "measured",
                          "hardware": table["hardware"], "changed": changed}
    sealed = write_manifest(out, manifest)
    return {"files": len(sealed["files"]), "changed": changed}
