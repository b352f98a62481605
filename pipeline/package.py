"""The package stage: an HF checkpoint directory in, a sealed artifact directory out."""

from __future__ import annotations

import json
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path

from infer.runtime.artifact import MANIFEST, verify_artifact, write_manifest

from .stage import DONE

ARTIFACT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                  "chat_template.jinja", "model.safetensors.index.json")
_TRACKED_PACKAGES = ("infer", "torch", "safetensors", "tokenizers", "gguf", "transformers", "llmcompressor",
                     "compressed-tensors")


def build_environment() -> dict:
    """Versions of what shaped the bytes: recorded in the manifest, part of the stage key."""
    versions = {}
    for name in _TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"python": platform.python_version(), "packages": versions}


def package(checkpoint: Path, out: Path, manifest: dict) -> dict:
    """Copies the model files into ``out`` and seals them with a manifest listing every file's hash."""
    names = sorted({p.name for p in checkpoint.glob("*.safetensors")} |
                   {n for n in ARTIFACT_FILES if (checkpoint / n).is_file()})
    for name in names:
        shutil.copyfile(checkpoint / name, out / name)
    config = json.loads((out / "config.json").read_text())
    model = {
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type"),
        "dtype": config.get("dtype") or config.get("torch_dtype"),
        "max_model_len": config.get("max_position_embeddings"),
        "vocab_size": config.get("vocab_size"),
    }
    sealed = write_manifest(out, {**manifest, "model": model,
                                  "quantization": config.get("quantization_config")})
    return {"files": len(sealed["files"]), "bytes": sum(f["size"] for f in sealed["files"].values())}


def publish(stage_dir: Path, output_dir: Path) -> Path:
    """Copies a finished artifact to ``output_dir`` atomically: readers see the old one or the new one."""
    output_dir = output_dir.expanduser().absolute()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_dir.with_name(f".{output_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(stage_dir, tmp, ignore=shutil.ignore_patterns(DONE), copy_function=shutil.copyfile)
    verify_artifact(tmp)  # what lands is checked, not assumed
    if output_dir.exists():
        if not (output_dir / MANIFEST).exists() and any(output_dir.iterdir()):
            shutil.rmtree(tmp)
            raise FileExistsError(f"{output_dir}: exists and is not an artifact; choose another output_dir "
                                  f"or remove it (infer-build only replaces earlier artifacts)")
        old = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}")
        os.replace(output_dir, old)
        os.replace(tmp, output_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, output_dir)
    return output_dir
