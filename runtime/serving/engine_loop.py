"""The engine thread: steps an ``LLMEngine`` for the HTTP server and accounts its metrics.

The engine is synchronous; it runs in its own thread, which takes commands (add, abort) from a
queue between steps, steps while there is work, and hands each output to its request handler's
asyncio queue with ``loop.call_soon_threadsafe`` as ``(output, Finished or None, time.perf_counter() when
handed over)``. The engine thread never waits on a client: a slow reader only lets its own queue
grow, and the batch keeps stepping. With ``--step-trace`` it also writes each step's record there.

A request the engine fails alone arrives as an output with finish_reason "error" (see
``LLMEngine.step``). A step that raises outside any request's work fails every request in flight
with a 500 error object each, leaves the engine empty and consistent, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass

from .protocol import APIError

log = logging.getLogger("infer.server")


@dataclass
class _Track:
    """Engine-thread bookkeeping of one engine request."""
    rid: str
    queue: asyncio.Queue
    arrival: float
    prompt_len: int
    first_token: float | None = None
    last_token: float | None = None
    counted_prompt: bool = False


@dataclass
class Finished:
    """Timings attached to a request's last output (seconds)."""
    queue_time: float | None
    time_to_first_token: float | None
    e2e_latency: float
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class EngineLoop:
    """Steps an ``LLMEngine`` in a thread; requests and aborts come in through a command queue."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, metrics, log_requests: bool = False, trace=None):
        self.engine = engine
        self.loop = loop
        self.metrics = metrics
        self.log_requests = log_requests
        self.trace = trace  # serving.trace.StepTrace (--step-trace), or None
        self._traced_step = 0
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._tracks: dict[str, _Track] = {}
        self._stop = False
        self._abort_all = False
        self.thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self.error: BaseException | None = None

    # ---- called from the asyncio thread
    def start(self) -> None:
        self.thread.start()

    def add(self, rid: str, prompt_ids: list[int], params, queue: asyncio.Queue, arrival: float,
            priority: int = 0, tenant: str = "") -> None:
        with self._lock:
            self._pending_adds += 1
        self._cmds.append(("add", rid, prompt_ids, params, queue, arrival, priority, tenant))
        self._wake.set()

    def abort(self, rid: str) -> None:
        self._cmds.append(("abort", rid))
        self._wake.set()

    def abort_all(self) -> None:
        self._abort_all = True
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._abort_all = True
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running: still in the command queue or in the scheduler's queue."""
        return self._pending_adds + len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def snapshot(self) -> dict:
        e = self.engine
        bm = e.block_manager
        return {"running": self.num_running, "waiting": self.num_waiting, "kv_usage": e.kv_usage(),
                "blocks_used": bm.num_blocks - bm.num_free_blocks, "blocks_total": bm.num_blocks,
                "prefix_queries": bm.prefix_queries, "prefix_hits": bm.prefix_hits,
                "preemptions": e.scheduler.num_preemptions, "steps": e.stats.get("steps", 0),
                **{k: v for k, v in e.stats.items() if k.startswith("spec_")}}

    # ---- engine thread
    def _deliver(self, queue: asyncio.Queue, item) -> None:
        try:
            self.loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _drain(self) -> None:
        while self._cmds:
            cmd = self._cmds.popleft()
            if cmd[0] == "add":
                _, rid, ids, params, queue, arrival, priority, tenant = cmd
                try:
                    self.engine.add_request(rid, ids, params, priority=priority, tenant=tenant)
                    self._tracks[rid] = _Track(rid, queue, arrival, len(ids))
                except Exception as e:  # validated before, so this is rare: hand it to the handler
                    param = str(e).split("=", 1)[0] if "=" in str(e)[:40] else None
                    self._deliver(queue, APIError(400, str(e), param=param))
                finally:
                    with self._lock:
                        self._pending_adds -= 1
            else:
                self._abort(cmd[1])

    def _abort(self, rid: str) -> None:
        track = self._tracks.pop(rid, None)
        out = self.engine.abort_request(rid)
        if track is not None and out is not None:
            self._account(track, out, time.monotonic())
            self._deliver(track.queue, (out, self._finished(track, out, time.monotonic()), time.perf_counter()))

    def _abort_everything(self) -> None:
        for rid in list(self._tracks):
            self._abort(rid)

    def _account(self, t: _Track, out, at: float) -> None:
        m = self.metrics
        n = len(out.delta_token_ids)
        if n:
            m.generation_tokens.inc(n)
            if t.first_token is None:
                t.first_token = out.metrics.get("first_token_time") or at
                m.ttft.observe(max(0.0, t.first_token - t.arrival))
                sched = out.metrics.get("first_scheduled_time")
                if sched is not None:
                    m.queue.observe(max(0.0, sched - t.arrival))
                    m.prefill.observe(max(0.0, t.first_token - sched))
            elif t.last_token is not None:
                m.itl.observe(max(0.0, at - t.last_token) / n)
            t.last_token = at
        if not t.counted_prompt and (n or out.finished):
            t.counted_prompt = True
            if n:
                m.prompt_tokens.inc(t.prompt_len)
        if out.finished:
            m.finished(out.finish_reason)
            m.e2e.observe(max(0.0, at - t.arrival))
            m.e2e_sum += max(0.0, at - t.arrival)
            m.e2e_n += 1
            ntok = len(out.token_ids)
            m.prompt_len.observe(t.prompt_len)
            m.gen_len.observe(ntok)
            if ntok > 1 and t.first_token is not None:
                m.tpot.observe(max(0.0, at - t.first_token) / (ntok - 1))

    def _finished(self, t: _Track, out, at: float) -> Finished:
        sched = out.metrics.get("first_scheduled_time")
        return Finished(
            queue_time=(sched - t.arrival) if sched is not None else None,
            time_to_first_token=(t.first_token - t.arrival) if t.first_token is not None else None,
            e2e_latency=at - t.arrival, num_preemptions=out.metrics.get("num_preemptions", 0) or 0,
            num_cached_tokens=out.num_cached_tokens)

    def _run(self) -> None:
        engine = self.engine
        while True:
            self._wake.clear()
            self._drain()
            if self._abort_all:
                self._abort_all = False
                self._abort_everything()
            if self._stop:
                return
            if not engine.has_unfinished_requests():
                if self.trace is not None:
                    self.trace.write()
                self._wake.wait(0.5)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # an engine bug must not take the server down: fail the requests in flight
                log.exception("engine step failed outside any one request; failing %d request(s)", len(self._tracks))
                self.error = e
                for rid, track in list(self._tracks.items()):
                    self._tracks.pop(rid, None)
                    with contextlib.suppress(Exception):
                        engine.abort_request(rid)
                    self.metrics.finished("error")
                    self._deliver(track.queue, APIError(500, f"engine error: {type(e).__name__}: {e}",
                                                        type="server_error", code="engine_error"))
                continue
            at, produced = time.monotonic(), time.perf_counter()
            for out in outputs:
                track = self._tracks.get(out.request_id)
                if track is None:
                    continue
                self._account(track, out, at)
                if out.finished:
                    del self._tracks[out.request_id]
                    self._deliver(track.queue, (out, self._finished(track, out, at), produced))
                else:
                    self._deliver(track.queue, (out, None, produced))
            if self.trace is not None:  # after the outputs are on their way
                self._trace_step()

    def _trace_step(self) -> None:
        records = self.engine.step_records
        if records and records[-1].step != self._traced_step:  # a step that scheduled nothing leaves none
            self._traced_step = records[-1].step
            self.trace.add(records[-1].as_dict())
        self.trace.write()


def load_engine(state, loop: asyncio.AbstractEventLoop) -> None:
    """Loader thread: builds the engine, then starts its loop; /health turns ready at the end."""
    from ..engine.engine import LLMEngine
    from .protocol import ModelInfo, TokenText, fan_out_limit
    from .tool_calls import ToolSupport

    try:
        t0 = time.monotonic()
        engine = LLMEngine(state.artifact, state.config.engine)
        state.engine = engine
        state.plan = engine.plan.describe()
        tools = ToolSupport.for_template(engine.tokenizer.chat_template)
        log.info("tools: %s", f"rendered by {tools.source}" if tools else "refused (no template renders them)")
        engine.grammars.compiler()  # the grammar engine's view of the vocabulary, built before the first request
        state.info = ModelInfo(state.name, state.version, engine.max_request_tokens, engine.model.config.vocab_size,
                               engine.tokenizer, fan_out_limit(state.config.max_queue), grammars=engine.grammars,
                               tools=tools)
        state.token_text = TokenText(engine.tokenizer)
        runner = EngineLoop(engine, loop, state.metrics, state.config.log_requests, trace=state.trace)
        state.loop_runner = runner
        state.metrics.snapshot = runner.snapshot
        runner.start()
        state.ready = True
        c = state.config
        print(f"infer-run: {state.name} {state.version} loaded in {time.monotonic() - t0:.1f}s "
              f"({engine.num_blocks} KV blocks of {engine.config.block_size} tokens, context limit "
              f"{engine.max_request_tokens}); ready on http://{c.host}:{c.port}/v1", flush=True)
    except Exception as e:
        state.load_error = f"{type(e).__name__}: {e}"
        print(f"infer-run: error: cannot load the model: {e}", file=sys.stderr, flush=True)
        if state.on_failure:
            state.on_failure()
