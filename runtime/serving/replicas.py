"""``infer-replicas ARTIFACT --replicas N``: N ``infer-run`` replicas on one machine behind the
prefix-aware router (router.py), each restarted when it dies, rolled onto a new artifact one by one.

What this adds to the router: starting the replicas with the machine's cores split between them
(``sched_setaffinity`` and one thread pool each), noticing a replica that exits (out of the router
at once, started again, back once ``/health`` says ready), and the rolling upgrade: on SIGHUP each
replica in turn stops getting new requests, finishes what it has (drained at the router, then
infer-run's SIGTERM), starts again on what ARTIFACT points at now, and is put back. Replicas on other
machines join with ``--worker URL`` (docs/replicas.md, multi-node); with ``--replicas 0`` this
machine runs the router alone, in front of its workers. Arguments it does not know go to every
infer-run.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from .router import POLICIES, Router

log = logging.getLogger("infer.replicas")


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the supervisor dies, even by SIGKILL (no orphans holding ports)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """``n`` disjoint, nearly equal slices of ``cores``; with fewer cores than replicas they share."""
    if n == 0:
        return []
    if n <= len(cores):
        k, extra = divmod(len(cores), n)
        out, at = [], 0
        for i in range(n):
            size = k + (i < extra)
            out.append(cores[at:at + size])
            at += size
        return out
    return [[cores[i % len(cores)]] for i in range(n)]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None,
                 stop: threading.Event | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (proc is not None and proc.poll() is not None) or (stop is not None and stop.is_set()):
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


class Replica:
    """One ``infer-run`` child on its own port and cores."""

    def __init__(self, index: int, artifact: str, port: int, cores: list[int], run_args: list[str], log_dir: Path):
        self.index, self.artifact, self.port, self.cores, self.run_args = index, artifact, port, cores, run_args
        self.log_path = log_dir / f"replica-{index}.log"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.version = None  # what ARTIFACT resolved to when this replica started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.version = os.path.realpath(self.artifact)
        env = dict(os.environ, OMP_NUM_THREADS=str(len(self.cores)))
        cores = set(self.cores)
        cmd = [sys.executable, "-m", "infer.runtime.cli", self.version, "--host", "127.0.0.1",
               "--port", str(self.port), *self.run_args]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=lambda: (_die_with_parent(), os.sched_setaffinity(0, cores)))
        log.info("replica %d: pid %d on port %d, cores %s, %s", self.index, self.proc.pid, self.port,
                 self.cores, self.version)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float) -> None:
        """SIGTERM (infer-run drains for its grace period), SIGKILL past ``grace`` + 10 s."""
        if not self.alive():
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Deployment:
    """The replicas, the router, and the watcher thread that keeps them up."""

    def __init__(self, args: argparse.Namespace, run_args: list[str]):
        self.args = args
        self.log_dir = Path(args.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cores = sorted(os.sched_getaffinity(0))
        slices = split_cores(cores, args.replicas)
        self.replicas = [Replica(i, args.artifact, args.port + 1 + i, slices[i], run_args, self.log_dir)
                         for i in range(args.replicas)]
        self.router = Router([r.url for r in self.replicas] + args.worker, args.policy,
                             cache_blocks=args.router_cache_blocks)
        self.stopping = threading.Event()
        self.upgrade_requested = threading.Event()

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            if not wait_healthy(r.url, self.args.start_timeout, r.proc, self.stopping):
                raise RuntimeError(f"replica {r.index} did not become ready; see {r.log_path}")
            self.router.backend(r.url).healthy = True
        what = f"{len(self.replicas)} replica(s) of {self.args.artifact}" if self.replicas else "no local replica"
        workers = f" and {len(self.args.worker)} worker(s), up once their /health says ok" if self.args.worker else ""
        print(f"infer-replicas: {what}{workers} ready behind {self.args.policy} routing on "
              f"http://{self.args.host}:{self.args.port}/v1 (logs in {self.log_dir})", flush=True)

    def _revive(self, r: Replica) -> None:
        """Out of the router, started again; the router's health check puts it back once it is ready.
        (Called from the watch thread, which lives as long as the deployment: a child's PDEATHSIG fires
        when the thread that started it ends.)"""
        code = r.proc.returncode if r.proc else None
        self.router.mark_down(r.url)
        self.router.backend(r.url).cache.clear()  # a fresh process holds no prefixes
        log.warning("replica %d (port %d) exited with %s: out of the router, starting it again", r.index, r.port, code)
        r.restarts += 1
        r.start()

    def upgrade(self) -> None:
        """Replica by replica: out of the router, drained, started on what ARTIFACT points at now, back in."""
        if not self.replicas:
            print("infer-replicas: no local replica to upgrade (upgrade the workers with their service manager)",
                  flush=True)
            return
        target = os.path.realpath(self.args.artifact)
        print(f"infer-replicas: rolling upgrade to {target}", flush=True)
        for r in self.replicas:
            b = self.router.backend(r.url)
            b.draining = True  # no new requests; those in flight finish
            deadline = time.monotonic() + self.args.grace_period
            while b.inflight and time.monotonic() < deadline:
                time.sleep(0.1)
            r.stop(self.args.grace_period)
            b.healthy = False
            b.cache.clear()  # a fresh process holds no prefixes
            r.start()
            ok = wait_healthy(r.url, self.args.start_timeout, r.proc, self.stopping)
            b.draining = False
            if not ok:
                raise RuntimeError(f"replica {r.index} did not come back on {target}; see {r.log_path}")
            b.healthy = True
        print("infer-replicas: upgrade done", flush=True)

    def watch(self) -> None:
        while not self.stopping.is_set():
            if self.upgrade_requested.is_set():
                self.upgrade_requested.clear()
                try:
                    self.upgrade()
                except RuntimeError as e:
                    print(f"infer-replicas: upgrade failed: {e}", file=sys.stderr, flush=True)
            for r in self.replicas:
                if not r.alive() and not self.stopping.is_set():
                    self._revive(r)
            self.stopping.wait(0.1)

    def stop(self) -> None:
        self.stopping.set()
        threads = [threading.Thread(target=r.stop, args=(self.args.grace_period,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="infer-replicas", description="N infer-run replicas of an artifact behind a prefix-aware router. "
        "Arguments it does not know go to every infer-run (e.g. --dtype bfloat16 --tenants tenants.yaml).")
    p.add_argument("artifact", nargs="?", help="artifact directory, or a symlink to one: SIGHUP rolls the replicas "
                                               "onto what it points at then (not needed with --replicas 0)")
    p.add_argument("--replicas", type=int, default=2,
                   help="infer-run processes on this machine (default 2; 0: the router alone, in front of --worker)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000,
                   help="the router's port; replica i listens on PORT+1+i on loopback (default 8000)")
    p.add_argument("--policy", choices=POLICIES, default="prefix",
                   help="prefix: to the replica holding the request's prefix, balanced against load (default); "
                        "round_robin")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a replica on another machine (infer-run URL) that the router also sends to")
    p.add_argument("--router-cache-blocks", type=int, default=4096, metavar="N",
                   help="prefix blocks (256 characters each) the router remembers per replica: about its KV cache "
                        "(default 4096)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds a draining replica's in-flight requests get (default 30)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a replica may take to load")
    p.add_argument("--log-dir", default="infer-replicas-logs", help="where replica and router logs go")
    args, run_args = p.parse_known_args(argv)
    if args.replicas < 0:
        p.error("--replicas must be at least 0")
    if args.replicas == 0 and not args.worker:
        p.error("--replicas 0 runs the router alone: give it replicas on other machines with --worker URL")
    if args.replicas > 0 and args.artifact is None:
        p.error("the artifact is required with local replicas (or --replicas 0 with --worker URL)")
    if args.artifact is not None and not Path(args.artifact).is_dir():
        p.error(f"{args.artifact} is not an artifact directory")
    if "--port" in run_args or "--host" in run_args:
        p.error("--port and --host are the router's; replicas listen on PORT+1+i")
    run_args += ["--grace-period", str(args.grace_period)]
    return args, run_args


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, run_args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    try:
        dep = Deployment(args, run_args)
    except ValueError as e:
        raise SystemExit(f"infer-replicas: error: {e}")
    done = threading.Event()

    def finish(*_):
        done.set()
        dep.stopping.set()

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    signal.signal(signal.SIGHUP, lambda *_: dep.upgrade_requested.set())
    try:
        dep.start()
    except RuntimeError as e:
        dep.stop()
        if done.is_set():
            return
        raise SystemExit(f"infer-replicas: error: {e}")
    threading.Thread(target=dep.watch, name="infer-replicas-watch", daemon=True).start()
    import uvicorn

    try:  # uvicorn takes SIGINT/SIGTERM from here: it stops, then so do the replicas
        uvicorn.run(dep.router.app(), host=args.host, port=args.port, log_level="warning", http="h11",
                    timeout_keep_alive=5)
    finally:
        print("infer-replicas: stopping", flush=True)
        dep.stop()


if __name__ == "__main__":
    main()
