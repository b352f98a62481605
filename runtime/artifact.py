"""The artifact format: the one contract between the build pipeline and the runtime.

An artifact is a directory: an HF-format model (config.json, safetensors weights, tokenizer) plus
``manifest.json``, which records what was built from what and the sha256 and size of every
other file. The runtime opens an artifact only after checking every file against the manifest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

FORMAT = "infer-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ArtifactError(Exception):
    """An artifact that must not be loaded; the message says which file and what to do."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(root: Path) -> dict[str, dict]:
    """sha256 and size of every file under root except the manifest, by relative path, sorted."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {p.relative_to(root).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size} for p in files}


def dump_json(data, path: Path) -> None:
    """Canonical JSON (sorted keys, fixed indent): the same data always gives the same bytes."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_manifest(root: Path, manifest: dict) -> dict:
    """Seals a directory as an artifact: hashes every file into the manifest, written last."""
    manifest = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "files": describe_files(root)}
    dump_json(manifest, root / MANIFEST)
    return manifest


@dataclass(frozen=True)
class Artifact:
    """A verified artifact: what ``verify_artifact`` returns and every consumer is handed, so a
    command hashes its files once and parses ``config.json`` once."""
    path: Path
    manifest: dict
    config: dict  # config.json, parsed

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def version(self) -> str:
        return self.manifest["version"]

    def weight_files(self) -> list[Path]:
        """The safetensors files the manifest lists, in name order."""
        return [self.path / rel for rel in sorted(self.manifest["files"]) if rel.endswith(".safetensors")]


def verify_artifact(path: str | Path) -> Artifact:
    """Checks an artifact against its manifest; raises ArtifactError naming the first problem."""
    root = Path(path)
    rebuild = "rebuild it with infer-build, or restore it from where it was published"
    if not root.is_dir():
        raise ArtifactError(f"{root}: not an artifact directory (it does not exist or is not a directory)")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(f"{manifest_path}: missing; {root} is not a complete artifact ({rebuild})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{manifest_path}: not valid JSON ({e}); {rebuild}") from e
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{manifest_path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{manifest_path}: artifact format version {version!r} is not supported by this runtime "
            f"(it reads version {FORMAT_VERSION}); rebuild the artifact with a matching infer-build, "
            f"or run it with the infer release that built it"
        )
    files = manifest.get("files") or {}
    for rel, expected in files.items():
        file = root / rel
        if not file.is_file():
            raise ArtifactError(f"{file}: listed in the manifest but missing; {rebuild}")
        if file.stat().st_size != expected["size"]:
            raise ArtifactError(
                f"{file}: size {file.stat().st_size} differs from the manifest's {expected['size']}: "
                f"the file was changed or truncated; {rebuild}"
            )
        if sha256_file(file) != expected["sha256"]:
            raise ArtifactError(f"{file}: sha256 differs from the manifest: the file was changed; {rebuild}")
    extra = sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST and p.relative_to(root).as_posix() not in files
    )
    if extra:
        raise ArtifactError(f"{root / extra[0]}: not listed in the manifest (an unexpected file); remove it or {rebuild}")
    for required in ("config.json", "tokenizer.json"):
        if required not in files:
            raise ArtifactError(f"{root / required}: the manifest lists no {required}; {rebuild}")
    try:
        config = json.loads((root / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{root / 'config.json'}: not valid JSON ({e}); {rebuild}") from e
    return Artifact(root, manifest, config)
