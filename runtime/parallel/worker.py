"""The loop every rank but 0 runs: load this rank's slice, then run each step rank 0 broadcasts.

Started by rank 0 (``python -m infer.runtime.parallel.worker ARTIFACT``, RANK etc. in its
environment) or by a launcher (``torchrun ... infer-run ARTIFACT``: infer-run becomes this loop
where RANK > 0). It checks only what it opens (config.json and its own rank file, against rank
0's manifest), reports to rank 0 through the store when loaded (or why not), and exits when rank
0 says stop, or on its own when rank 0 goes away: its connection closes, or no word comes within
``INFER_TP_TIMEOUT`` seconds (rank 0 sends a heartbeat while idle).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch

from ..artifact import ArtifactError
from ..model.llama import DenseCausalContext
from . import distributed as d

log = logging.getLogger("infer.parallel")


def _follow_parent() -> None:
    """A rank started by rank 0 exits when rank 0 is gone, even when rank 0 was killed outright.
    (Polled: PR_SET_PDEATHSIG would fire when the *thread* that started it ends, a server's loader.)"""
    parent = os.environ.get("INFER_TP_PARENT")
    if not parent:
        return

    def watch():
        while os.getppid() == int(parent):
            time.sleep(1.0)
        log.error("rank 0 (pid %s) is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="infer-tp-parent", daemon=True).start()


def _load(path: str, rank: int, world: int, setup: dict):
    from infer.kernels.resolver import resolve

    from ..engine.engine import _DTYPES, load_tuning
    from ..model.llama import ModelConfig
    from .layers import AllReduce, load_slice

    artifact = d.verify_rank(path, rank, setup["digest"], setup["tuning"])
    head_dim = ModelConfig.from_hf(artifact.config).head_dim
    tuning = load_tuning(artifact, setup["tuning"])
    kernels = lambda dt: resolve(setup["kernels"], amx=setup["amx"], dtype=dt, head_dim=head_dim,
                                 block_size=setup["block_size"])
    reduce = AllReduce()
    dtype = _DTYPES[setup["dtype"]] if setup["dtype"] else None
    model = load_slice(artifact, rank, world, dtype, kernels, tuning, reduce)
    return model, tuning, reduce


def run_worker(path: str) -> int:
    """Rank RANK of WORLD_SIZE for the artifact at ``path``; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank, world = d.launched()
    _follow_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it tells the ranks to stop
    store = d.env_store(rank, world)
    setup = d.get(store, "setup")
    me = {"pid": os.getpid(), "host": d.host()}
    threads, cores, local = d.threads_per_rank(world)
    torch.set_num_threads(threads)
    start = time.monotonic()
    try:
        model, tuning, reduce = _load(path, rank, world, setup)
    except Exception as e:  # reported to rank 0, which names this rank in its error
        log.exception("rank %d: cannot load its slice", rank)
        d.put(store, f"loaded/{rank}", {**me, "error": f"{type(e).__name__}: {e}",
                                        "kind": "artifact" if isinstance(e, ArtifactError) else "load"})
        return 1
    d.put(store, f"loaded/{rank}", {**me, "dtype": str(model.dtype), "threads": threads})
    log.info("rank %d/%d: slice loaded in %.1fs (%s, %d thread(s): %d cores / %d ranks on %s)", rank, world,
             time.monotonic() - start, model.dtype, threads, cores, local, me["host"])
    blocks = d.get(store, "blocks")
    if "abort" in blocks:
        log.error("rank %d: %s; exiting", rank, blocks["abort"])
        return 1
    from ..engine.model_runner import ModelRunner

    try:
        kv_dtype = getattr(torch, blocks["kv_dtype"]) if blocks.get("kv_dtype") else None
        runner = ModelRunner(model, blocks["num_blocks"], setup["block_size"], model.kernels, tuning, kv_dtype=kv_dtype)
    except Exception as e:  # noqa: BLE001 - e.g. no memory for the KV cache
        d.put(store, f"ready/{rank}", {**me, "error": f"KV cache: {type(e).__name__}: {e}"})
        return 1
    runner.max_threads = threads
    d.put(store, f"ready/{rank}", {**me, "kv_dtype": str(runner.kv_cache.dtype).removeprefix("torch.")})
    reduce.group = pg = d.connect(store, rank, world)
    return serve_steps(pg, runner, rank)


@torch.inference_mode()
def serve_steps(pg, runner, rank: int) -> int:
    """Runs every step rank 0 sends until it says stop (0), or until the group breaks (1)."""
    header = torch.empty(d.HEADER, dtype=torch.long)
    while True:
        try:
            pg.broadcast(header, 0).wait()
            command = int(header[0])
            if command == d.NOOP:
                continue
            if command == d.STOP:
                log.info("rank %d: stopping", rank)
                return 0
            if command == d.STEP:
                payload = torch.empty(d.step_size(header), dtype=torch.long)
                pg.broadcast(payload, 0).wait()
                runner.forward(d.decode_step(header, payload))
            elif command == d.DENSE:
                b, length = int(header[1]), int(header[2])
                ids = torch.empty(b * length, dtype=torch.long)
                pg.broadcast(ids, 0).wait()
                # rank 0's Transformer.logits: the same windows (a sliding layer's mask), or rank 1 attends in full
                model = runner.model
                model(ids, torch.arange(length).repeat(b), DenseCausalContext(b, length, model.config.layer_windows))
            else:
                log.error("rank %d: unknown command %d from rank 0 (a different infer release?); exiting", rank, command)
                return 1
        except Exception as e:  # noqa: BLE001 - rank 0 went away, or this rank's step failed: either way, out
            log.error("rank %d: leaving the tensor-parallel group: %s: %s", rank, type(e).__name__, e)
            return 1


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or d.launched() is None:
        sys.exit("usage: RANK=r WORLD_SIZE=n MASTER_ADDR=host MASTER_PORT=port "
                 "python -m infer.runtime.parallel.worker ARTIFACT (rank 0 starts these itself)")
    sys.exit(run_worker(argv[0]))


if __name__ == "__main__":
    main()
