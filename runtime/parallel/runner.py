"""Rank 0's side of tensor parallelism: the other ranks, their liveness, and the runner that steps them.

``RankGroup.start`` finds the other ranks (torchrun's) or starts them, and publishes the engine's
settings, so they load their slices while rank 0 loads its own (``load_model``). ``runner`` gives
them the KV cache size, connects the process group and returns a ``TensorParallelRunner``: each
step it broadcasts the step's inputs, then runs the same forward pass, whose all-reduces the
other ranks join. All traffic on the group holds one lock, so steps, the idle heartbeat and the
stop message never interleave.

A rank that dies ends the group for good (the ranks are out of step): ``error`` names the rank
and is what every later step raises and what /health reports. Rank 0 notices a worker it started
at once (a thread waits on each process); any other through the collective that fails (gloo
reports a closed connection at once, a silent peer after ``INFER_TP_TIMEOUT``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import threading
import time
import weakref

import torch

from ..artifact import Artifact, ArtifactError
from ..engine.model_runner import ModelRunner, StepInputs
from ..model.llama import Transformer
from . import distributed as d
from . import tensor_parallel_size
from .layers import AllReduce, load_slice

log = logging.getLogger("infer.parallel")
_env_taken = False  # a process launched as rank 0 (RANK/WORLD_SIZE) joins one group only


class WorkerDied(RuntimeError):
    """A tensor-parallel rank is gone or out of step: this engine cannot step any more; restart it."""


class RankGroup:
    def __init__(self, artifact: Artifact, tp: int, store, procs, threads: int, threads_before: int):
        self.artifact, self.tp, self.store, self.procs, self.threads = artifact, tp, store, procs, threads
        self.threads_before = threads_before  # this process's own count, restored on close
        self.reduce = AllReduce()
        self.broadcast_seconds = 0.0  # sending the steps' inputs (the benchmark reports it)
        self.pg = None
        self.error: str | None = None
        self.ranks: dict[int, dict] = {}  # each worker's report: pid, host, dtype, threads
        self._lock = threading.Lock()  # every message on the group
        self._error_lock = threading.Lock()
        self._closed = threading.Event()
        self._last = time.monotonic()
        # until runner() connects the group, dropping it (a failed engine) kills what it started
        self._reaper = weakref.finalize(self, _reap, procs, store)

    @classmethod
    def start(cls, artifact: Artifact, config) -> RankGroup:
        """Joins the launcher's ranks (RANK/WORLD_SIZE set) or starts ranks 1..tp-1 here, and tells them
        what to load. ``config``: the engine's EngineConfig (dtype, kernels, block size, tuning)."""
        global _env_taken
        tp = tensor_parallel_size(artifact)
        d.check_layout(artifact, tp)
        for r in range(tp):
            d.rank_file(artifact, r)
        env = d.launched()
        if env is not None:
            rank, world = env
            if world != tp:
                raise ValueError(f"WORLD_SIZE={world}, but {artifact.path} is sharded for tp={tp}: launch {tp} "
                                 f"processes (torchrun --nproc-per-node {tp} ...), or unset RANK and WORLD_SIZE "
                                 f"to let infer-run start them")
            if rank != 0:
                raise ValueError(f"RANK={rank}: only rank 0 runs the engine; run the other ranks as "
                                 f"`infer-run ARTIFACT` under the same launcher (they become workers)")
            if _env_taken:
                raise ValueError("this process was launched as rank 0 of one tensor-parallel group (RANK, "
                                 "WORLD_SIZE set): it can run one tensor-parallel engine, not two")
            _env_taken = True
            store = d.env_store(0, tp)
        else:
            store = d.local_store(tp)
        threads, cores, local = d.threads_per_rank(tp)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        d.put(store, "setup", {"digest": d.manifest_digest(artifact), "dtype": config.dtype, "kernels": config.kernels,
                               "amx": config.amx, "block_size": config.block_size, "tuning": config.tuning})
        procs = None if env is not None else d.spawn_workers(artifact.path, tp, store.port)
        how = ("launched by the environment (env://: MASTER_ADDR, RANK, WORLD_SIZE)" if env is not None else
               f"{'rank 1' if tp == 2 else f'ranks 1-{tp - 1}'} started on this machine (pid "
               f"{', '.join(str(p.pid) for p in procs)})")
        log.info("tensor parallel: %d ranks over gloo, %s; %d thread(s) per rank (%d cores / %d ranks on this "
                 "machine)", tp, how, threads, cores, local)
        return cls(artifact, tp, store, procs, threads, before)

    # ------------------------------------------------------------------ loading
    def load_model(self, path, dtype, kernels, *, hf_config=None, files=None, tuning=None) -> Transformer:
        """Rank 0's slice (its own rank file, not ``files``: the whole artifact's), once every other rank
        reports its own loaded; load_model's signature, so the engine calls either the same way."""
        try:
            model = load_slice(self.artifact, 0, self.tp, dtype, kernels, tuning, self.reduce)
            self.ranks = self._wait_all("loaded")
            for r, info in self.ranks.items():
                if info.get("dtype") != str(model.dtype):
                    raise RuntimeError(f"tensor-parallel rank {r} loaded its slice in {info.get('dtype')}, rank 0 in "
                                       f"{model.dtype}; give every rank the same --dtype")
            return model
        except BaseException:
            self.close()
            raise

    def runner(self, model: Transformer, num_blocks: int, block_size: int, kernels, tuning=None,
               kv_dtype: torch.dtype | None = None, prompt_rows: str = "auto") -> TensorParallelRunner:
        """The KV cache's size and dtype to every rank (each allocates its own KV heads' cache), then the
        process group: the engine's runner."""
        try:
            d.put(self.store, "blocks", {"num_blocks": num_blocks,
                                         "kv_dtype": str(kv_dtype).removeprefix("torch.") if kv_dtype else None})
            self.ranks = self._wait_all("ready")
            self.pg = self._connect()
            self.reduce.group = self.pg
        except BaseException:
            self.close()
            raise
        self._reaper.detach()
        atexit.register(self.close)
        for rank, proc in enumerate(self.procs or [], start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"infer-tp-watch-{rank}", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="infer-tp-heartbeat", daemon=True).start()
        model.logits = functools.partial(self._dense_logits, model)
        runner = TensorParallelRunner(model, num_blocks, block_size, kernels, tuning, self, kv_dtype, prompt_rows)
        runner.max_threads = self.threads
        return runner

    def _wait_all(self, phase: str) -> dict[int, dict]:
        """Every worker's ``phase`` report, watching that the ones started here stay alive."""
        limit = d.timeout().total_seconds()
        out = {}
        for r in range(1, self.tp):
            got = d.wait_until(lambda r=r: d.poll(self.store, f"{phase}/{r}") or self._exited(r), limit)
            if isinstance(got, str):
                raise WorkerDied(f"{got} while loading; its log above says why")
            if not got:
                raise WorkerDied(f"tensor-parallel rank {r} did not report '{phase}' within {limit:g}s "
                                 f"(INFER_TP_TIMEOUT); is it running, and can it reach rank 0's store?")
            if "error" in got:
                kind = ArtifactError if got.get("kind") == "artifact" else RuntimeError
                raise kind(f"tensor-parallel rank {r} ({got.get('host')}): {got['error']}")
            out[r] = got
        return out

    def _connect(self):
        """The process group, connected in a helper thread so a worker dying meanwhile is noticed."""
        box: dict = {}

        def connect():
            try:
                box["pg"] = d.connect(self.store, 0, self.tp)
            except Exception as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e

        thread = threading.Thread(target=connect, name="infer-tp-connect", daemon=True)
        thread.start()
        dead = d.wait_until(lambda: not thread.is_alive() or self._find_dead(), d.timeout().total_seconds())
        if isinstance(dead, str):
            raise WorkerDied(f"{dead} while connecting")
        if "error" in box or "pg" not in box:
            raise WorkerDied(f"the tensor-parallel group did not connect: {box.get('error', 'timed out')}")
        return box["pg"]

    # ------------------------------------------------------------------ liveness
    def _exited(self, rank: int) -> str | None:
        """Why a worker this process started is gone (None: alive, or not ours to watch)."""
        if not self.procs:
            return None
        proc = self.procs[rank - 1]
        code = proc.poll()
        return None if code is None else f"tensor-parallel rank {rank} (pid {proc.pid}) {d.describe_exit(code)}"

    def _find_dead(self) -> str | None:
        for r in range(1, self.tp):
            why = self._exited(r)
            if why is None and not self.procs:  # torchrun's ranks: those on this machine can be checked
                info = self.ranks.get(r, {})
                if info.get("host") == d.host() and info.get("pid") and not d.pid_alive(info["pid"]):
                    why = f"tensor-parallel rank {r} (pid {info['pid']}) is gone"
            if why:
                return why
        return None

    def _set_error(self, why: str) -> None:
        with self._error_lock:
            if self.error is None:
                self.error = why
                log.error("%s", why)

    def _watch(self, rank: int, proc) -> None:
        code = proc.wait()
        if not self._closed.is_set():
            self._set_error(f"tensor-parallel rank {rank} (pid {proc.pid}) {d.describe_exit(code)}: the engine "
                            f"cannot step without it; restart the server")
            self._terminate()  # the others are out of step: stop them rather than let them wait

    def _fail(self, e: BaseException) -> WorkerDied:
        """A step broke off: the ranks are out of step for good. Names the rank that died where one did."""
        if self.error is None:
            dead = d.wait_until(self._find_dead, 3.0)  # a killed worker's exit lands a moment after its socket closes
            self._set_error(f"{dead}: the engine cannot step without it; restart the server" if dead else
                            f"a tensor-parallel step failed ({type(e).__name__}: {e}); a rank died or stopped "
                            f"answering, and the ranks are out of step: restart the server")
        self._terminate()
        return WorkerDied(self.error)

    @contextlib.contextmanager
    def step(self):
        """Holds the group for one message exchange; any failure in it ends the group."""
        with self._lock:
            if self.error is not None:
                raise WorkerDied(self.error)
            if self.pg is None or self._closed.is_set():
                raise WorkerDied("the tensor-parallel group is closed")
            try:
                yield self.pg
            except BaseException as e:
                failure = self._fail(e)
                if isinstance(e, Exception):
                    raise failure from e
                raise
            self._last = time.monotonic()

    def _heartbeat(self) -> None:
        """An empty header while idle, so that waiting workers see rank 0 alive within their timeout."""
        interval = min(5.0, d.timeout().total_seconds() / 10)
        while not self._closed.wait(interval / 2):
            if self.error is not None:
                return
            if time.monotonic() - self._last < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if self.error is None and not self._closed.is_set():
                    self.pg.broadcast(d.header(d.NOOP), 0).wait()
                    self._last = time.monotonic()
            except Exception as e:  # noqa: BLE001 - a dead peer, found while idle
                self._fail(e)
            finally:
                self._lock.release()

    # ------------------------------------------------------------------ messages
    def send_step(self, pg, inputs: StepInputs) -> None:
        start = time.perf_counter()
        header, payload = d.encode_step(inputs)
        pg.broadcast(header, 0).wait()
        pg.broadcast(payload, 0).wait()
        self.broadcast_seconds += time.perf_counter() - start

    def _dense_logits(self, model: Transformer, input_ids: torch.Tensor) -> torch.Tensor:
        """``Transformer.logits`` (evaluation's whole-sequence forward) with every rank taking part."""
        with self.step() as pg:
            b, length = input_ids.shape
            pg.broadcast(d.header(d.DENSE, b, length), 0).wait()
            pg.broadcast(input_ids.reshape(-1).to(torch.long).contiguous(), 0).wait()
            return Transformer.logits(model, input_ids)

    # ------------------------------------------------------------------ shutdown
    def _terminate(self) -> None:
        _reap(self.procs, None, grace=2.0)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the other ranks: a stop message where the group is healthy, then waits, then kills
        what this process started and is still running. Idempotent; runs at exit too."""
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.close)
        got = self._lock.acquire(timeout=timeout)
        try:
            if got and self.pg is not None and self.error is None:
                with contextlib.suppress(Exception):
                    self.pg.broadcast(d.header(d.STOP), 0).wait()
        finally:
            if got:
                self._lock.release()
        if self.pg is None:  # workers still setting up: tell them
            with contextlib.suppress(Exception):
                d.put(self.store, "blocks", {"abort": "rank 0 stopped before the ranks were connected"})
        _reap(self.procs, None, grace=timeout)
        self._reaper.detach()
        torch.set_num_threads(self.threads_before)


def _reap(procs, store, grace: float = 2.0) -> None:
    """Waits ``grace`` seconds for the processes to exit, then terminates, then kills them."""
    if store is not None:
        with contextlib.suppress(Exception):
            d.put(store, "blocks", {"abort": "rank 0's engine was dropped before the ranks were connected"})
    deadline = time.monotonic() + grace
    for proc in procs or []:
        with contextlib.suppress(Exception):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs or []:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(3)
            except Exception:  # noqa: BLE001
                proc.kill()
                proc.wait(3)


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner: each step's inputs go to every rank, then the same forward runs here."""

    def __init__(self, model, num_blocks, block_size, kernels, tuning, group: RankGroup, kv_dtype=None,
                 prompt_rows: str = "auto"):
        super().__init__(model, num_blocks, block_size, kernels, tuning, kv_dtype=kv_dtype, prompt_rows=prompt_rows)
        self.group = group

    @property
    def error(self) -> str | None:
        return self.group.error

    def bursts(self, rows: int) -> bool:
        """Never: a burst's steps would have to reach every rank (each step's inputs go out through forward)."""
        return False

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        with self.group.step() as pg:
            self.group.send_step(pg, inputs)
            return super().forward(inputs)

    def close(self) -> None:
        self.group.close()
