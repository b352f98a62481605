"""Text the build calibrates and evaluates on: one place, so the two never overlap.

The built-in corpus is Python's own ``pydoc_data.topics`` (shipped with every CPython, so it
works offline): its topics sorted by key, the even positions are the *calibration* split and the
odd positions the *evaluation* split. Quantization calibrates on the first, evaluation and
accuracy gates measure on the second.

A recipe's ``calib.data`` (or ``eval.data``) may instead name a user's data:
- ``pydoc_topics``: the built-in split (calibration or evaluation, by who asks);
- a ``.txt`` file: its whole text, one document (windows are cut from the token stream anyway);
- a ``.jsonl`` file: one JSON object a line, its ``text`` field, or a conversation
  (``{"messages": [{"role": "user", "content": ...}, ...]}``);
- a directory: a dataset saved with ``datasets.Dataset.save_to_disk`` (a ``text`` column), or
  else every ``*.txt`` / ``*.jsonl`` file in it, in sorted order.

Calibration also covers what the model is asked as a chat model (``calib.chat_fraction``):
``conversations`` gives the data's own conversations, or else builds user/assistant turns from
its documents (a question about a passage's topic, the passage as the answer);
``chat_windows`` renders them through the model's chat template, special tokens included, each
window starting where a conversation starts, as a chat request does.

Everything here is deterministic: the same data, tokenizer, seed and sizes give the same windows.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
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


ROLES = ("system", "user", "assistant")


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value):
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\": one of {', '.join(ROLES)}, "
                        f"\"content\": \"...\"}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _jsonl_rows(path: Path, key: str) -> list[str | list[dict]]:
    """A .jsonl file's rows: a document (``text``) or a conversation (``messages``) each."""
    rows: list[str | list[dict]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{key}={path}: line {n} is not JSON ({e.msg})") from None
        if isinstance(row, dict) and "messages" in row:
            rows.append(_messages(row["messages"], f"{key}={path}: line {n}"))
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            rows.append(row["text"])
        else:
            raise DataError(f"{key}={path}: line {n} has no string 'text' field; each line must be "
                            f'{{"text": "..."}} or {{"messages": [...]}}')
    return rows


def _flatten(conversation: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in conversation)


def _jsonl(path: Path, key: str = "calib.data") -> list[str]:
    """A .jsonl file's documents; a conversation counts as the text of its turns."""
    return [r if isinstance(r, str) else _flatten(r) for r in _jsonl_rows(path, key)]


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


def load_conversations(data: str, key: str = "calib.data") -> list[list[dict]]:
    """The conversations ``data`` holds itself: ``{"messages": [...]}`` rows of .jsonl files (or a
    ``messages`` column of a saved dataset). Empty for the built-in corpus and plain text."""
    if data == BUILTIN:
        return []
    path = Path(data).expanduser()
    if path.is_file():
        files = [path] if path.suffix == ".jsonl" else []
    elif (path / "dataset_info.json").is_file() or (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train" if "train" in ds else sorted(ds)[0]]
        if "messages" not in ds.column_names:
            return []
        return [_messages(m, f"{key}={data!r}: row {i}") for i, m in enumerate(ds["messages"])]
    else:
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file()) if path.is_dir() else []
    return [r for f in files for r in _jsonl_rows(f, key) if not isinstance(r, str)]


# A chat user asks about something; the calibration passage answers. Which question a passage gets
# depends only on its position and the seed.
QUESTIONS = (
    "What is {topic}?",
    "Explain {topic}.",
    "Can you explain {topic} with an example?",
    "How does {topic} work in Python?",
    "Summarize what the documentation says about {topic}.",
    "I have a question about {topic}. What should I know?",
    "Tell me about {topic}.",
    "What are the rules for {topic}?",
)
CHUNK_CHARS = 1200  # an answer of a few hundred tokens: a chat turn's length, not a whole document


def _topic(line: str) -> str:
    t = re.sub(r"[*=#`_\-]+", " ", line).strip(" .:")
    t = " ".join(t.split())
    if t.startswith("The "):
        t = "the " + t[4:]
    if len(t) > 80:
        t = t[:80].rsplit(" ", 1)[0]
    return t or "this"


def conversations_from_texts(texts: Sequence[str], seed: int = 0) -> list[list[dict]]:
    """User/assistant turns built from documents: each document cut at blank lines into passages of
    about CHUNK_CHARS; the user asks about the document's topic (its first line), the assistant's answer
    is the passage (a title and its underline are not repeated in it)."""
    rng = random.Random(seed)
    out: list[list[dict]] = []
    for text in texts:
        lines = text.strip().splitlines()
        if not lines:
            continue
        topic = _topic(lines[0])
        body = lines[1:] if len(lines) > 1 and len(lines[0]) <= 80 else lines
        while body and (not body[0].strip() or re.fullmatch(r"[*=#\-~^]+", body[0].strip())):
            body = body[1:]
        paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", "\n".join(body)) if p.strip()]
        chunk: list[str] = []
        for para in paragraphs + [None]:
            if chunk and (para is None or sum(map(len, chunk)) + len(para) > CHUNK_CHARS):
                question = QUESTIONS[rng.randrange(len(QUESTIONS))].format(topic=topic)
                out.append([{"role": "user", "content": question}, {"role": "assistant", "content": "\n\n".join(chunk)}])
                chunk = []
            if para is not None:
                chunk.append(para)
    return out


def chat_windows(conversations: Sequence[list[dict]], render, seq_len: int, samples: int,
                 seed: int = 0) -> list[list[int]]:
    """``samples`` windows of exactly ``seq_len`` tokens of rendered conversations (``render(messages)
    -> ids``, the chat template with its special tokens). Each window starts at a conversation's
    first token (a chat request's position 0, where the largest activations are) and runs on through
    the following conversations; seeded choice of the starting conversations, in order."""
    if samples <= 0:
        return []
    if not conversations:
        raise DataError("calib.chat_fraction: the data has no conversations to render; set calib.chat_fraction=0")
    rendered = [list(render(c)) for c in conversations]
    n = len(rendered)
    if sum(map(len, rendered)) < seq_len:
        raise DataError(f"calib.seq_len={seq_len}: the conversations hold only {sum(map(len, rendered))} tokens, "
                        f"less than one window; use shorter windows or more data")
    if samples <= n:
        starts = sorted(random.Random(seed).sample(range(n), samples))
    else:  # fewer conversations than windows: every conversation starts several
        starts = [i % n for i in range(samples)]
    windows = []
    for s in starts:
        ids: list[int] = []
        i = s
        while len(ids) < seq_len:
            ids += rendered[i % n]
            i += 1
        windows.append(ids[:seq_len])
    return windows


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
