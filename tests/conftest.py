"""Shared fixtures: one build of the embedded model per test session, in a private cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("infer-cache")


@pytest.fixture(scope="session")
def embedded_artifact(tmp_path_factory, cache_dir) -> Path:
    """The default recipe built into a temporary directory (float32)."""
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    out = tmp_path_factory.mktemp("artifacts") / "smollm2"
    build(compose_recipe([f"output_dir={out}", f"cache_dir={cache_dir}"]))
    return out


@pytest.fixture(scope="session")
def embedded_llm(embedded_artifact):
    from infer.runtime import LLM

    return LLM(embedded_artifact, kv_cache_memory=512 << 20)


@pytest.fixture(scope="session")
def hf_reference(embedded_artifact):
    """transformers' own model on the artifact's files: the reference, never the thing tested."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_artifact, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(embedded_artifact)
    return model, tok


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs a console script of this package the way a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    bin_dir = Path(sys.executable).parent
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)
