"""Ranks and their process group: rendezvous, launching ranks, verifying a rank's files, the messages.

Rendezvous is torch's ``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` (what
torchrun sets, one process per rank on one machine or several). Launched without them, rank 0
hosts the store on a free loopback port and starts the other ranks on this machine itself
(``spawn_workers``), with those variables set for them.

Setup goes through the store (rank 0 publishes the engine settings; each rank reports when its
slice is loaded, or why it is not), so that rank 0 can watch its workers' liveness while it
waits. Each engine has its own process group and store prefix rather than torch's default group,
so one process can hold two tensor-parallel engines (an evaluation's variant and baseline).

Every step rank 0 broadcasts a fixed int64 header (command and sizes) and one int64 payload
(``encode_step``): tensors only, nothing pickled. While idle it broadcasts an empty header every
few seconds, so a worker waiting for the next step can tell a quiet server from a dead one by
the group's timeout (``INFER_TP_TIMEOUT``, seconds, default 300).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..artifact import (CONFIG, LAYOUT_FILE, LAYOUT_FORMAT, LAYOUT_VERSION, MANIFEST, TUNING, Artifact, ArtifactError,
                        inside, sha256_file)
from ..engine.model_runner import StepInputs

PREFIX = "infer-tp"
HEADER = 8  # int64s: command, then its sizes
NOOP, STEP, DENSE, STOP = 0, 1, 2, 3


def timeout() -> datetime.timedelta:
    """How long a rank waits for another (loading, a step's collective) before giving up."""
    return datetime.timedelta(seconds=float(os.environ.get("INFER_TP_TIMEOUT", "300")))


def launched() -> tuple[int, int] | None:
    """(rank, world size) when a launcher (torchrun, a cluster script) set ``RANK`` and ``WORLD_SIZE``."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"RANK={os.environ['RANK']!r} WORLD_SIZE={os.environ['WORLD_SIZE']!r}: not integers; "
                         f"launch with torchrun, or unset both to let infer-run start the ranks") from None


def threads_per_rank(world: int) -> tuple[int, int, int]:
    """(threads, cores, ranks on this machine): the machine's cores split between its ranks, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return max(1, cores // local), cores, local


def env_store(rank: int, world: int):
    """The launcher's store (``env://``): rank 0 hosts it unless torchrun's agent already does."""
    import torch.distributed as dist

    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout()))
    return store


def local_store(world: int):
    """A store for ranks this process starts itself: on loopback, on a port the OS picks."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, True, timeout(), wait_for_workers=False)


def connect(store, rank: int, world: int, backend: str = "gloo"):
    """This engine's process group; blocks until every rank has connected. gloo: the engine runs on
    the CPU; nccl is here for when it places models on CUDA devices (untested: no GPU engine yet)."""
    import torch.distributed as dist

    store = dist.PrefixStore(f"{PREFIX}/pg", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout()
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout())


def spawn_workers(artifact: Path, world: int, port: int) -> list[subprocess.Popen]:
    """Ranks 1..world-1 on this machine, each ``python -m infer.runtime.parallel.worker ARTIFACT``."""
    procs = []
    for rank in range(1, world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
               "INFER_TP_PARENT": str(os.getpid())}
        procs.append(subprocess.Popen([sys.executable, "-m", "infer.runtime.parallel.worker", str(artifact)],
                                      env=env, stdin=subprocess.DEVNULL))
    return procs


def key(name: str) -> str:
    return f"{PREFIX}/{name}"


def put(store, name: str, value: dict) -> None:
    store.set(key(name), json.dumps(value))


def get(store, name: str) -> dict:
    """Waits (up to the store's timeout) for ``name`` and returns it."""
    return json.loads(store.get(key(name)))


def poll(store, name: str) -> dict | None:
    """``name`` if it was set, without waiting."""
    return json.loads(store.get(key(name))) if store.check([key(name)]) else None


def host() -> str:
    return socket.gethostname()


# ---------------------------------------------------------------------------- the artifact, per rank

def manifest_digest(artifact: Artifact) -> str:
    return sha256_file(artifact.path / MANIFEST)


def check_layout(artifact: Artifact, tp: int) -> None:
    """tensor_parallel.json is one this runtime serves: its format, version, rank count, and the
    embedding and LM head replicated (a vocab-parallel build is for GPU-sized vocabularies)."""
    path = artifact.path / LAYOUT_FILE
    fix = "rebuild the artifact with this release's infer-build (parallel.tp=N)"
    if LAYOUT_FILE not in artifact.manifest.get("files", {}):
        raise ArtifactError(f"{path}: the manifest says parallel.tp={tp} but lists no {LAYOUT_FILE}; {fix}")
    try:
        layout = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not readable JSON ({e}); {fix}") from None
    if layout.get("format") != LAYOUT_FORMAT or layout.get("format_version") != LAYOUT_VERSION:
        raise ArtifactError(f"{path}: format {layout.get('format')!r} version {layout.get('format_version')!r}; "
                            f"this runtime serves {LAYOUT_FORMAT!r} version {LAYOUT_VERSION}; {fix}")
    if layout.get("tp_size") != tp:
        raise ArtifactError(f"{path}: tp_size {layout.get('tp_size')!r} but the manifest says parallel.tp={tp}; {fix}")
    vocab = sorted(n for n, t in layout.get("tensors", {}).items() if t.get("split") == "vocab")
    if vocab:
        raise ArtifactError(f"{path}: {vocab[0]} is split over the vocabulary (vocab_parallel); this runtime serves "
                            f"a replicated embedding and LM head: shard without vocab_parallel")


def rank_file(artifact: Artifact, rank: int) -> Path:
    """The one safetensors file rank ``rank`` loads: the manifest's ``parallel.ranks[rank]``, which
    must be a weights file the manifest lists with the same hash."""
    manifest = artifact.manifest
    entry = (manifest.get("parallel") or {}).get("ranks", {}).get(str(rank))
    where = f"{artifact.path / MANIFEST}: parallel.ranks[{rank}]"
    if not isinstance(entry, dict) or len(entry) != 1:
        raise ArtifactError(f"{where} is {entry!r}, not {{file: sha256}}; rebuild the artifact with infer-build")
    (rel, digest), = entry.items()
    listed = manifest.get("files", {}).get(rel)
    if not rel.endswith(".safetensors") or not isinstance(listed, dict) or listed.get("sha256") != digest:
        raise ArtifactError(f"{where} names {rel!r}, which is not a safetensors file the manifest lists with that "
                            f"sha256; rebuild the artifact with infer-build")
    return inside(artifact.path, rel, f"parallel.ranks[{rank}]")


def verify_rank(path: str | Path, rank: int, digest: str, tuning: str = "auto") -> Artifact:
    """A worker's check of what it opens: the manifest is rank 0's (which verified every file), and
    config.json, this rank's file (and tuning.json where used) match it. Other ranks' files it never reads."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(f"{manifest_path}: missing on rank {rank} ({host()}); every machine needs the same artifact")
    if sha256_file(manifest_path) != digest:
        raise ArtifactError(f"{manifest_path}: differs from rank 0's (rank {rank} on {host()} has another artifact "
                            f"or version at this path); copy rank 0's artifact there")
    manifest = json.loads(manifest_path.read_text())
    artifact = Artifact(root, manifest, {})
    files = [CONFIG, rank_file(artifact, rank).relative_to(root).as_posix()]
    if tuning == "auto" and TUNING in manifest.get("files", {}):
        files.append(TUNING)
    for rel in files:
        file = inside(root, rel, "manifest entry")
        expected = manifest["files"].get(rel) or {}
        if not file.is_file() or file.stat().st_size != expected.get("size") or sha256_file(file) != expected.get("sha256"):
            raise ArtifactError(f"{file}: missing or differs from the manifest on rank {rank} ({host()}): the file "
                                f"was changed; restore it from where the artifact was published")
    return Artifact(root, manifest, json.loads((root / CONFIG).read_text()))


# ---------------------------------------------------------------------------- the messages

def encode_step(s: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step: every tensor of StepInputs in one flat int64 tensor; the header's last
    field says whether the decode rows' sliding-window starts follow."""
    windowed = s.decode_starts is not None
    header = torch.tensor([STEP, len(s.input_ids), s.chunk_blocks.shape[0], s.chunk_blocks.shape[1],
                           s.decode_blocks.shape[0], s.decode_blocks.shape[1], _decode_path(s), int(windowed)])
    payload = torch.cat([s.input_ids, s.positions, s.slots, s.chunk_starts, s.chunk_lengths, s.chunk_contexts,
                         s.chunk_blocks.flatten(), s.decode_rows, s.decode_blocks.flatten(), s.decode_lens]
                        + ([s.decode_starts] if windowed else []))
    return header, payload


def step_size(header: torch.Tensor) -> int:
    _, t, p, w, d, wd, _, windowed = header.tolist()
    return 3 * t + 3 * p + p * w + 2 * d + d * wd + windowed * d


def decode_step(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    _, t, p, w, d, wd, decode_path, windowed = header.tolist()
    parts = payload.split([t, t, t, p, p, p, p * w, d, d * wd, d, windowed * d])
    # one_call stays False: a tensor-parallel rank runs the layer loop (the C++ step has no all-reduce)
    return StepInputs(*parts[:6], parts[6].view(p, w), parts[7], parts[8].view(d, wd), parts[9],
                      decode_kernel=decode_path > 0, decode_starts=parts[10] if windowed else None,
                      bf16_dots=decode_path != 2)


def _decode_path(s: StepInputs) -> int:
    """A step's decode attention as one header field: 0 gather + SDPA, 1 the C++ kernel, 2 it on its float path."""
    return 0 if not s.decode_kernel else 1 if s.bf16_dots else 2


def header(command: int, *sizes: int) -> torch.Tensor:
    out = torch.zeros(HEADER, dtype=torch.long)
    out[0] = command
    out[1:1 + len(sizes)] = torch.tensor(sizes, dtype=torch.long)
    return out


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine is alive (a zombie is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def wait_until(check, seconds: float, interval: float = 0.05):
    """Polls ``check()`` until it returns something truthy or ``seconds`` pass; returns the last result."""
    deadline = time.monotonic() + seconds
    while True:
        result = check()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval)
