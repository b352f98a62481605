"""Stages as pure functions whose outputs are cached on disk by a hash of their inputs.

A stage writes its output into a fresh temporary directory; only when it returns is the
directory renamed to ``<cache>/<stage>/<key>``, so a build killed half way leaves no stage
looking finished and resumes from the last one that was. A second identical build finds every
key and does no work.

Test hook: ``INFER_TEST_PAUSE_AT=<stage>:<point>`` (points: ``started``, the temporary directory made
and empty; ``written``, the output and its record written, not yet renamed into place; and
publish's ``publish:copied`` and ``publish:swapped``) makes the build print
``infer-test-paused <stage>:<point>`` to stderr and sleep there, so tests/test_build_faults.py can
``kill -9`` it at exactly that point. Unset, as outside those tests, it does nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from tqdm import tqdm

from infer.runtime.artifact import MANIFEST, TOKENIZER_FILES

log = logging.getLogger("infer.build")


class BuildError(Exception):
    """A build that cannot go on; the message says why and what to do."""
DONE = "_stage.json"
# What every stage carries from its input checkpoint to its output, byte for byte: the tokenizer files,
# and transformers' special_tokens_map.json, which nothing here reads and no artifact carries, kept so
# that each stage's checkpoint holds its source's files.
CARRIED_FILES = (*TOKENIZER_FILES, "special_tokens_map.json")
PAUSE_ENV = "INFER_TEST_PAUSE_AT"


def pause_point(point: str) -> None:
    """The test hook above: sleeps at ``point`` when INFER_TEST_PAUSE_AT names it, else returns."""
    if os.environ.get(PAUSE_ENV) == point:
        print(f"infer-test-paused {point}", file=sys.stderr, flush=True)
        time.sleep(3600)


def content_key(*parts) -> str:
    """sha256 of canonical JSON of the parts: the identity of a stage's inputs."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class StageResult:
    name: str
    key: str
    path: Path
    cached: bool
    seconds: float
    info: dict
    peak_anon_bytes: int | None = None  # what this run of the stage held at most (None: cached, or no /proc)


def anon_bytes(pid: int | None = None) -> int | None:
    """Anonymous resident memory of a process and its descendants (``RssAnon``: what the kernel must keep in
    RAM or swap, unlike ``ru_maxrss``, which also counts mapped file pages such as an mmap-ed checkpoint), or
    None where /proc is not there."""
    pid = os.getpid() if pid is None else pid
    total, todo = 0, [pid]
    try:
        while todo:
            p = todo.pop()
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return None if p == pid else total  # no /proc, or a child that ended while being read
    except OSError:
        return total
    return total


class PeakMemory:
    """The most ``anon_bytes`` seen while the block runs, sampled every quarter second on a thread (a stage's
    peak is brief allocations apart: calibration caches, a compressed copy beside the originals)."""

    def __init__(self, every: float = 0.25):
        self.every, self.peak, self._stop = every, anon_bytes(), threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            now = anon_bytes()
            if now is not None:
                self.peak = max(self.peak or 0, now)

    def __enter__(self) -> "PeakMemory":
        if self.peak is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.peak is not None:
            self._thread.join()
            self.peak = max(self.peak, anon_bytes() or 0)


def run_stage(cache_dir: Path, name: str, inputs: dict, fn: Callable[[Path], dict | None]) -> StageResult:
    """Runs ``fn(out_dir) -> info`` unless a finished output for these inputs exists."""
    key = content_key(name, inputs)
    final = Path(cache_dir) / "stages" / name / key[:32]
    done = final / DONE
    if done.is_file():
        record = json.loads(done.read_text())
        log.info("stage %-9s cached  (%s)", name, key[:12])
        return StageResult(name, key, final, True, record["seconds"], record.get("info") or {})
    tmp = final.with_name(f".tmp-{key[:32]}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log.info("stage %-9s running (%s)", name, key[:12])
    start = time.perf_counter()
    try:
        pause_point(f"{name}:started")
        with PeakMemory() as memory:
            info = fn(tmp) or {}
        seconds = round(time.perf_counter() - start, 3)
        (tmp / DONE).write_text(json.dumps({"stage": name, "key": key, "inputs": inputs, "seconds": seconds, "info": info},
                                           indent=2, sort_keys=True, default=str))
        pause_point(f"{name}:written")
        shutil.rmtree(final, ignore_errors=True)  # a stale, unfinished output of an older layout
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    peak = memory.peak
    log.info("stage %-9s done    in %.1fs%s", name, seconds,
             "" if peak is None else f", peak anonymous memory {peak / 2**30:.2f} GiB")
    return StageResult(name, key, final, False, seconds, info, peak)


def progress(items: Iterable, desc: str, total: int | None = None):
    """A progress bar on a terminal; on CI (no terminal) a few plain log lines instead."""
    if sys.stderr.isatty():
        yield from tqdm(items, desc=desc, total=total, leave=False)
        return
    items = list(items)
    n = len(items)
    marks = {max(1, round(n * f)) for f in (0.25, 0.5, 0.75, 1.0)}
    for i, item in enumerate(items, 1):
        yield item
        if i in marks:
            log.info("%s: %d/%d", desc, i, n)


@contextmanager
def artifact_view(path: Path, dst: Path) -> Iterator[Path]:
    """``path`` as an exact artifact while the block runs: a stage directory carries its _stage.json record,
    which an artifact's verification refuses, so it is seen through a link view at ``dst`` (removed after);
    anything else (a published artifact) as it is."""
    if not (path / DONE).exists():
        yield path
        return
    try:
        yield link_tree(path, dst, with_manifest=True)
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def link_tree(src: Path, dst: Path, with_manifest: bool = False) -> Path:
    """A stage's files into dst: hard links (cache entries are immutable), copies where links fail."""
    skip = (DONE,) if with_manifest else (MANIFEST, DONE)
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_dir() or rel.as_posix() in skip:
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        link_file(p, target)
    return dst


def copy_carried_files(src: Path, out: Path) -> None:
    """The CARRIED_FILES that ``src`` has, copied into ``out``."""
    for name in CARRIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def link_file(src: Path, dst: Path) -> None:
    """One file of a cache entry into dst: a hard link (entries are immutable), a copy where links fail."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
