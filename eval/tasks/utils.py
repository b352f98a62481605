"""Loaders for the local tasks: JSONL files next to this module, read without any network."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def _jsonl(name: str):
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_lastword(**kwargs):
    return _jsonl("infer_lastword.jsonl")


def load_mc(**kwargs):
    return _jsonl("infer_mc.jsonl")
