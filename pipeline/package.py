"""The package stage: an HF checkpoint directory in, a sealed artifact directory out."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
from importlib import metadata
from pathlib import Path

from infer.runtime.artifact import (ARTIFACT_FILES, CONFIG, FORMAT, LAYOUT_FILE, MANIFEST, sha256_file, verify_artifact,
                                    write_manifest)

from .stage import DONE, link_file, pause_point

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
    """Links the model files of ``checkpoint`` (a cache entry) into ``out`` and seals them with a manifest
    listing every file's hash."""
    names = sorted({p.name for p in checkpoint.glob("*.safetensors")} |
                   {n for n in ARTIFACT_FILES if (checkpoint / n).is_file()})
    for name in names:
        link_file(checkpoint / name, out / name)
    config = json.loads((out / CONFIG).read_text())
    model = {
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type"),
        "dtype": config.get("dtype") or config.get("torch_dtype"),
        "max_model_len": config.get("max_position_embeddings"),
        "vocab_size": config.get("vocab_size"),
    }
    parallel = {"parallel": _parallel_summary(out)} if (out / LAYOUT_FILE).is_file() else {}
    sealed = write_manifest(out, {**manifest, "model": model,
                                  "quantization": config.get("quantization_config"), **parallel})
    return {"files": len(sealed["files"]), "bytes": sum(f["size"] for f in sealed["files"].values())}


def _parallel_summary(out: Path) -> dict:
    """{tp, ranks: {rank: {file: sha256}}}: which file each tensor-parallel worker loads."""
    layout = json.loads((out / LAYOUT_FILE).read_text())
    missing = [f for f in layout["ranks"] if not (out / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{out}: {LAYOUT_FILE} lists rank files that are missing: {missing}")
    return {"tp": layout["tp_size"], "ranks": {str(r): {f: sha256_file(out / f)} for r, f in enumerate(layout["ranks"])}}


def publish(stage_dir: Path, output_dir: Path) -> Path:
    """Copies a finished artifact to ``output_dir`` atomically: readers see the old one or the new one.

    Only an earlier infer artifact (or an empty directory) is ever replaced, checked before the copy
    and again just before the swap; anything else is refused and left as it was. Leftovers of a
    publish that was killed (``.<name>.tmp-<host>-<pid>``, ``.<name>.old-...``) are cleaned up first."""
    output_dir = output_dir.expanduser().absolute()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_leftovers(output_dir)
    _refuse_unless_replaceable(output_dir)
    tag = f"{_host()}-{os.getpid()}"
    tmp = output_dir.with_name(f".{output_dir.name}.tmp-{tag}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(stage_dir, tmp, ignore=shutil.ignore_patterns(DONE), copy_function=shutil.copyfile)
    verify_artifact(tmp)  # what lands is checked, not assumed
    pause_point("publish:copied")
    try:
        _refuse_unless_replaceable(output_dir)  # again: it may have appeared or changed during the copy
    except FileExistsError:
        shutil.rmtree(tmp)
        raise
    if output_dir.exists():
        old = output_dir.with_name(f".{output_dir.name}.old-{tag}")
        os.replace(output_dir, old)
        pause_point("publish:swapped")
        os.replace(tmp, output_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, output_dir)
    return output_dir


def _refuse_unless_replaceable(output_dir: Path) -> None:
    """Raises FileExistsError unless ``output_dir`` is absent, an empty directory, or an artifact
    infer wrote (a manifest.json naming format infer-artifact) holding only the files it lists."""
    fix = "choose another output_dir, or move it away (infer-build only replaces artifacts it wrote)"
    if not os.path.lexists(output_dir):
        return
    if output_dir.is_symlink() or not output_dir.is_dir():
        raise FileExistsError(f"{output_dir}: exists and is not a directory (a file or a symlink); {fix}")
    if not any(output_dir.iterdir()):
        return
    manifest_path = output_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FileExistsError(f"{output_dir}: exists and is not an infer artifact (no readable {MANIFEST}: "
                              f"{type(e).__name__}); {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise FileExistsError(f"{output_dir}: exists and its {MANIFEST} is not an infer artifact's "
                              f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"not {FORMAT!r}); {fix}")
    own = {MANIFEST, *manifest["files"]}
    for parent, dirs, names in os.walk(output_dir):
        for name in names + [d for d in dirs if Path(parent, d).is_symlink()]:
            rel = Path(parent, name).relative_to(output_dir).as_posix()
            if rel not in own:
                raise FileExistsError(f"{output_dir}: an infer artifact, but it also holds {rel}, which its "
                                      f"manifest does not list and replacing it would delete; move that file "
                                      f"out, or {fix}")


def _host() -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname()) or "host"


def _remove_dead_leftovers(output_dir: Path) -> None:
    """Cleans up after a publish of this machine that was killed (its process is gone): its copy
    is removed, and an earlier artifact it had moved aside but not yet replaced is moved back
    (the swap rolled back), so nothing published is ever lost. Live builds' files are left alone."""
    dead = []
    for path in sorted(output_dir.parent.iterdir()):
        kind, _, pid = path.name.removeprefix(f".{output_dir.name}.").partition(f"-{_host()}-")
        if (path.name.startswith(f".{output_dir.name}.") and kind in ("tmp", "old") and pid.isdigit()
                and (int(pid) == os.getpid() or not _alive(int(pid)))):
            dead.append((kind, path))
    for kind, path in dead:
        if kind == "old" and not os.path.lexists(output_dir):
            os.replace(path, output_dir)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
