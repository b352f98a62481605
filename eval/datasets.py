"""Text the build calibrates and evaluates on: one place, so the two never overlap.

The built-in corpus is Python's own ``pydoc_data.topics`` (shipped with every CPython, so it
works offline): its topics sorted by key, the even positions are the *calibration* split and the
odd positions the *evaluation* split. Quantization calibrates on the first, evaluation and
accuracy gates measure on the second.

A recipe's ``calib.data`` (or ``eval.data``) may instead name a user's data:
- ``pydoc_topics``: the built-in split (calibration or evaluation, by who asks);
- a ``.txt`` file: its whole text, one document (windows are cut from the token stream anyway);
- a ``.jsonl`` file: one JSON object a line, its ``text`` field;
- a directory: a dataset saved with ``datasets.Dataset.save_to_disk`` (a ``text`` column), or
  else every ``*.txt`` / ``*.jsonl`` file in it, in sorted order.

Everything here is deterministic: the same data, tokenizer, seed and sizes give the same windows.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Sequence

BUILTIN = "pydoc_topics"


class DataError(ValueError):
    """Calibration or evaluation data that cannot be used; the message names it and the fix."""


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(k, topics[k]) for k in sorted(topics)]


def calibration_texts() -> list[str]:
    """The calibration split of pydoc_data.topics: topics at even positions of the sorted keys."""
    return [text for _, text in _topics()[0::2]]


def evaluation_texts() -> list[str]:
    """The evaluation split of pydoc_data.topics: topics at odd positions (disjoint from calibration)."""
    return [text for _, text in _topics()[1::2]]


def _jsonl(path: Path, key: str = "calib.data") -> list[str]:
    texts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{key}={path}: line {n} is not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DataError(f"{key}={path}: line {n} has no string 'text' field; each line must be "
                            f'{{"text": "..."}}')
        texts.append(row["text"])
    return texts


def load_texts(data: str, split: str = "calibration", key: str = "calib.data") -> list[str]:
    """The documents ``data`` names. ``split`` picks the half of the built-in corpus."""
    if data == BUILTIN:
        if split not in ("calibration", "evaluation"):
            raise ValueError(f"split={split!r}: calibration or evaluation")
        return calibration_texts() if split == "calibration" else evaluation_texts()
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"{key}={data!r}: no such file or directory; use {BUILTIN}, a .txt file, "
                        f"a .jsonl file with a 'text' field, or a dataset directory")
    if path.is_file():
        if path.suffix == ".txt":
            texts = [path.read_text(encoding="utf-8")]
        elif path.suffix == ".jsonl":
            texts = _jsonl(path, key)
        else:
            raise DataError(f"{key}={data!r}: unsupported file type {path.suffix!r}; use .txt or .jsonl")
    elif (path / "dataset_info.json").is_file() or (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            name = "train" if "train" in ds else sorted(ds)[0]
            ds = ds[name]
        if "text" not in ds.column_names:
            raise DataError(f"{key}={data!r}: the dataset has no 'text' column (columns: {ds.column_names})")
        texts = [t for t in ds["text"] if isinstance(t, str)]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise DataError(f"{key}={data!r}: the directory holds no saved dataset and no .txt or .jsonl files")
        texts = []
        for f in files:
            texts += [f.read_text(encoding="utf-8")] if f.suffix == ".txt" else _jsonl(f, key)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"{key}={data!r}: no text in it")
    return texts


def texts_digest(texts: Sequence[str]) -> str:
    """sha256 of the documents, in order: the data's identity in stage keys and manifests."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def token_windows(texts: Sequence[str], tokenizer, seq_len: int, samples: int, seed: int = 0) -> list[list[int]]:
    """``samples`` windows of exactly ``seq_len`` tokens from the documents joined by blank lines.

    The token stream is cut into consecutive non-overlapping windows; when there are more than
    ``samples`` of them, a seeded choice picks which (kept in stream order). When there are fewer,
    the windows overlap: ``samples`` starts evenly spaced over the stream. Fails only when the
    whole stream is shorter than one window.
    """
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t + "\n\n", add_special_tokens=False)
    if len(ids) < seq_len:
        raise DataError(f"calib.seq_len={seq_len}: the data has only {len(ids)} tokens, less than one window; "
                        f"use shorter windows or more data")
    n = len(ids) // seq_len
    if n >= samples:
        chosen = sorted(random.Random(seed).sample(range(n), samples)) if samples < n else list(range(n))
        return [ids[i * seq_len:(i + 1) * seq_len] for i in chosen]
    span = len(ids) - seq_len
    starts = [round(i * span / (samples - 1)) for i in range(samples)] if samples > 1 else [0]
    return [ids[s:s + seq_len] for s in starts]


def windows_digest(windows: Sequence[Sequence[int]]) -> str:
    """sha256 of the token windows as little-endian int32: exactly what calibration saw."""
    import struct

    h = hashlib.sha256()
    for w in windows:
        h.update(struct.pack(f"<{len(w)}i", *w))
    return h.hexdigest()
