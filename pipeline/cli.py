"""``infer-build``: Hydra composes the recipe, the build runs it. See ``infer-build --help``."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from infer.runtime.artifact import ArtifactError

from .build import BuildError, build
from .config import RecipeError, validate
from .gate import EvaluationError, GateFailed, record_sweep_variant
from .sources import SourceError

log = logging.getLogger("infer.build")

EXIT_BUILD_ERROR = 1
EXIT_BAD_RECIPE = 2
EXIT_GATE_FAILED = 3


@hydra.main(version_base=None, config_path="pkg://infer.recipes", config_name="build")
def _main(raw: DictConfig) -> None:
    try:
        cfg = validate(raw)
    except RecipeError as e:
        log.error("bad recipe: %s", e)
        sys.exit(EXIT_BAD_RECIPE)
    try:
        result = build(cfg)
    except GateFailed as e:  # the artifact was not published; the message names each gate, value, threshold
        log.error("gate failed: %s", e)
        if record_sweep_variant(e.doc, None) is not None:
            _sweep_gate_failures.append(cfg.artifact.name)  # a sweep goes on to its other variants, exits 3 at the end
            return
        sys.exit(EXIT_GATE_FAILED)
    except (BuildError, SourceError, ArtifactError, FileExistsError, EvaluationError) as e:
        log.error("build failed: %s", e)
        sys.exit(EXIT_BUILD_ERROR)
    record_sweep_variant(result.evaluation, result.artifact)
    print(result.artifact)


_sweep_gate_failures: list[str] = []


def main() -> None:
    _main()
    if _sweep_gate_failures:
        log.error("gates failed for %d variant(s) of the sweep: %s", len(_sweep_gate_failures),
                  ", ".join(_sweep_gate_failures))
        sys.exit(EXIT_GATE_FAILED)


if __name__ == "__main__":
    main()
