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
        record_sweep_variant(e.doc, None)
        sys.exit(EXIT_GATE_FAILED)
    except (BuildError, SourceError, ArtifactError, FileExistsError, EvaluationError) as e:
        log.error("build failed: %s", e)
        sys.exit(EXIT_BUILD_ERROR)
    record_sweep_variant(result.evaluation, result.artifact)
    print(result.artifact)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
