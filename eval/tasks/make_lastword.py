"""Regenerates ``infer_lastword.jsonl``: a LAMBADA-style last-word task from held-out text.

Passages come from the *evaluation* split of ``pydoc_data.topics`` (never the calibration
split). Each passage is a paragraph cut right after a word that already occurred earlier in it
(as in LAMBADA, the context holds what is needed to guess the word). The shipped file is a
snapshot, so the task does not change with the Python version; run this module to rebuild it:

    python eval/tasks/make_lastword.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

OUT = Path(__file__).with_name("infer_lastword.jsonl")
_WORD = re.compile(r"[A-Za-z]{4,}")


def passages(texts: list[str], count: int = 64, min_words: int = 25, max_words: int = 90) -> list[dict]:
    out = []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            words = para.split()
            if len(words) < min_words or "::=" in para or para.lstrip().startswith((">>>", "...")):
                continue
            words = words[:max_words]
            # the last position whose word is plain letters and appeared earlier in the passage
            for i in range(len(words) - 1, min_words - 2, -1):
                w = words[i]
                if _WORD.fullmatch(w) and w in words[:i]:
                    out.append({"text": " ".join(words[:i + 1])})
                    break
            if len(out) >= count:
                return out
    return out


def main() -> None:
    from infer.eval.datasets import evaluation_texts

    rows = passages(evaluation_texts())
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{OUT}: {len(rows)} passages")


if __name__ == "__main__":
    main()
