"""The artifact format: the one contract between the build pipeline and the runtime.

An artifact is a directory: an HF-format model (config.json, safetensors weights, tokenizer) plus
``manifest.json``, which records what was built from what and the sha256 and size of every
other file. The runtime opens an artifact only after checking every file against the manifest,
and opens nothing else: every path the manifest or the weights index names must be a plain
relative path that stays inside the directory (no ``..``, not absolute, no symlink leading out),
no symlink anywhere in it may lead out, and a file the runtime reads by name (tokenizer, chat
template, index) must be one the manifest lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "infer-artifact"
FORMAT_VERSION = 1
# The name of each file an artifact carries besides its weights (*.safetensors), declared here once:
# the build writes them (pipeline/), the runtime reads them.
MANIFEST = "manifest.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
CHAT_TEMPLATE = "chat_template.jinja"  # where transformers 5 saves the chat template
INDEX = "model.safetensors.index.json"
# tensor-parallel artifacts: the rank files' layout, its format and version (pipeline/shard.py)
LAYOUT_FILE, LAYOUT_FORMAT, LAYOUT_VERSION = "tensor_parallel.json", "infer-tensor-parallel", 1
# What the tokenizer is made of (runtime/engine/tokenizer.py reads them).
TOKENIZER_CONFIG, GENERATION_CONFIG = "tokenizer_config.json", "generation_config.json"
TOKENIZER_FILES = (TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE)
# The tune stage's table of kernel choices per batch bucket (runtime/tuning.py reads and writes it).
TUNING = "tuning.json"
# Every file an artifact carries by name, the ones the package stage takes from a checkpoint beside its
# weights. The runtime opens each by name when it exists, so each one present must be a file the
# manifest lists: nothing unverified is ever read.
ARTIFACT_FILES = (CONFIG, *TOKENIZER_FILES, INDEX, LAYOUT_FILE)


class ArtifactError(Exception):
    """An artifact that must not be loaded; the message says which file and what to do."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(root: Path, linked_from: Path | None = None) -> dict[str, dict]:
    """sha256 and size of every file under root except the manifest, by relative path, sorted.

    ``linked_from``: a sealed directory (a cache entry) whose files ``root`` hard-links: a file that is the
    very same inode as the one listed there keeps that listing's hash instead of being read again (a 7B
    artifact's 5 GB hashed once per build, not once per stage). A changed byte is still caught: the
    published copy and every load are checked against these hashes."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != MANIFEST)
    known = {}
    if linked_from is not None and (linked_from / MANIFEST).is_file():
        known = json.loads((linked_from / MANIFEST).read_text()).get("files") or {}
    out = {}
    for p in files:
        rel, size = p.relative_to(root).as_posix(), p.stat().st_size
        was = known.get(rel)
        same = (was is not None and was.get("size") == size and (linked_from / rel).is_file()
                and os.path.samefile(p, linked_from / rel))
        out[rel] = {"sha256": was["sha256"] if same else sha256_file(p), "size": size}
    return out


def inside(root: Path, rel, what: str) -> Path:
    """``root / rel`` for a path an artifact names (a manifest entry, an index's shard), refusing one
    that is not a plain relative path or that resolves, through symlinks, outside ``root``: such a
    path would make the runtime open a file nobody verified."""
    if (not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel or rel.startswith("/")
            or Path(rel).is_absolute() or any(part in ("", ".", "..") for part in rel.split("/"))):
        raise ArtifactError(f"{root}: {what} {rel!r} is not a plain relative path inside the artifact "
                            f"(absolute, empty, or with '.' or '..' parts); rebuild it with infer-build")
    path = root / rel
    base = _resolve(root)
    if not _resolve(path).is_relative_to(base):
        raise ArtifactError(f"{path}: {what} {rel!r} resolves to {_resolve(path)}, outside the artifact "
                            f"directory {base} (a symlink leading out); replace it with the file itself")
    return path


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop, an unreadable link
        raise ArtifactError(f"{path}: cannot be resolved ({e}); an artifact must hold plain files") from None


def _walk_entries(root: Path) -> list[str]:
    """Every entry under root that is not a directory (files, symlinks, anything else), relative,
    without following symlinked directories; refuses a symlink that leads out of root."""
    base = _resolve(root)
    entries = []
    for parent, dirs, names in os.walk(root, followlinks=False):
        for name in dirs + names:
            path = Path(parent, name)
            if path.is_symlink() and not _resolve(path).is_relative_to(base):
                raise ArtifactError(f"{path}: a symlink leading out of the artifact (to {_resolve(path)}); "
                                    f"an artifact must hold its own files: replace the link with the file")
        entries += [Path(parent, n).relative_to(root).as_posix() for n in names]
        entries += [Path(parent, d).relative_to(root).as_posix() for d in dirs if Path(parent, d).is_symlink()]
    return sorted(entries)


def dump_json(data, path: Path) -> None:
    """Canonical JSON (sorted keys, fixed indent): the same data always gives the same bytes."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_manifest(root: Path, manifest: dict, linked_from: Path | None = None) -> dict:
    """Seals a directory as an artifact: hashes every file into the manifest, written last
    (``linked_from``: see ``describe_files``)."""
    manifest = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION,
                "files": describe_files(root, linked_from)}
    dump_json(manifest, root / MANIFEST)
    return manifest


@dataclass(frozen=True)
class Artifact:
    """A verified artifact: what ``verify_artifact`` returns and every consumer is handed, so a
    command hashes its files once and parses ``config.json`` once."""
    path: Path
    manifest: dict
    config: dict  # config.json, parsed
    verify_seconds: float = field(default=0.0, compare=False)  # hashing every file: the load log reports it

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def version(self) -> str:
        return self.manifest["version"]

    @property
    def kv_cache_dtype(self) -> str | None:
        """The KV cache format the build chose (manifest ``kv_cache.dtype``: "int8", or the model's dtype),
        or None for an artifact that states none (the runtime then uses the model's dtype)."""
        kv = self.manifest.get("kv_cache")
        return kv.get("dtype") if isinstance(kv, dict) else None

    @property
    def speculative(self) -> dict:
        """The speculative decoding the build stated (manifest ``serving.speculative``: method, num_tokens,
        adaptive, verify_cost), or {} for none: the runtime's defaults."""
        serving = self.manifest.get("serving")
        spec = serving.get("speculative") if isinstance(serving, dict) else None
        return spec if isinstance(spec, dict) else {}

    def weight_files(self) -> list[Path]:
        """The safetensors files the manifest lists, in name order: the only weights the runtime
        opens (an index can name no other, verify_artifact checks)."""
        return [self.path / rel for rel in sorted(self.manifest["files"]) if rel.endswith(".safetensors")]


def _check_index(root: Path, files: dict, rebuild: str) -> None:
    """The weights index may name only shards the manifest lists, inside the artifact."""
    index = root / INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ArtifactError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e}); {rebuild}") from None
    if not isinstance(weight_map, dict):
        raise ArtifactError(f"{index}: weight_map is not an object; {rebuild}")
    for tensor, rel in sorted(weight_map.items()):
        inside(root, rel, f"{INDEX} entry {tensor!r} ->")
        if rel not in files or not rel.endswith(".safetensors"):
            raise ArtifactError(f"{index}: entry {tensor!r} names {rel!r}, which is not a safetensors file the "
                                f"manifest lists (an index may only name the artifact's verified weights); {rebuild}")


def verify_artifact(path: str | Path) -> Artifact:
    """Checks an artifact against its manifest; raises ArtifactError naming the first problem."""
    started = time.perf_counter()
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
    if not isinstance(files, dict):
        raise ArtifactError(f"{manifest_path}: 'files' is not an object of path -> {{sha256, size}}; {rebuild}")
    for rel, expected in files.items():
        file = inside(root, rel, "manifest entry")
        if (not isinstance(expected, dict) or not isinstance(expected.get("sha256"), str)
                or not isinstance(expected.get("size"), int)):
            raise ArtifactError(f"{manifest_path}: entry {rel!r} is not {{sha256, size}}; {rebuild}")
        if rel == MANIFEST:
            raise ArtifactError(f"{manifest_path}: lists itself; {rebuild}")
        if not file.is_file():
            raise ArtifactError(f"{file}: listed in the manifest but missing; {rebuild}")
        if not stat.S_ISREG(file.stat().st_mode):
            raise ArtifactError(f"{file}: listed in the manifest but not a regular file; {rebuild}")
        if file.stat().st_size != expected["size"]:
            raise ArtifactError(
                f"{file}: size {file.stat().st_size} differs from the manifest's {expected['size']}: "
                f"the file was changed or truncated; {rebuild}"
            )
        if sha256_file(file) != expected["sha256"]:
            raise ArtifactError(f"{file}: sha256 differs from the manifest: the file was changed; {rebuild}")
    extra = [rel for rel in _walk_entries(root) if rel != MANIFEST and rel not in files]
    if extra:
        raise ArtifactError(f"{root / extra[0]}: not listed in the manifest (an unexpected file); remove it or {rebuild}")
    for name in ARTIFACT_FILES:  # what the runtime opens by name: a listed file, or nothing at all
        if os.path.lexists(root / name) and name not in files:
            raise ArtifactError(f"{root / name}: the runtime reads it but the manifest does not list it; "
                                f"remove it or {rebuild}")
    if INDEX in files:
        _check_index(root, files, rebuild)
    for required in (CONFIG, TOKENIZER):
        if required not in files:
            raise ArtifactError(f"{root / required}: the manifest lists no {required}; {rebuild}")
    try:
        config = json.loads((root / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{root / CONFIG}: not valid JSON ({e}); {rebuild}") from e
    if not isinstance(config, dict):
        raise ArtifactError(f"{root / CONFIG}: not a JSON object; {rebuild}")
    return Artifact(root, manifest, config, time.perf_counter() - started)
