"""``infer-run ARTIFACT`` without ``--prompt``: the OpenAI-compatible HTTP server's life.

Serving state (``State``), the loader thread that builds the engine while ``/health`` says 503,
uvicorn with a draining SIGTERM, and ``serve``. The routes are in app.py, the engine thread in
engine_loop.py, request parsing in protocol.py, responses in responses.py, metrics in metrics.py.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from dataclasses import dataclass, field

from ..artifact import Artifact
from ..engine.engine import EngineConfig
from .protocol import APIError, ModelInfo, TokenText, now

log = logging.getLogger("infer.server")

DEFAULT_MAX_BODY = 32 << 20


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256
    log_requests: bool = False
    grace_period: float = 30.0
    max_body: int = DEFAULT_MAX_BODY
    access_log: bool = False
    step_trace: str | None = None  # a JSONL file: every engine step, event-loop lag, stream delays (trace.py)
    tenants: object = None  # serving.tenants.Tenants (--tenants): keys, rates, the scheduler's fair share
    engine: EngineConfig = field(default_factory=EngineConfig)


class State:
    """What the routes read: the engine once loaded, its loop, metrics, readiness."""

    def __init__(self, config: ServerConfig, artifact: Artifact):
        self.config = config
        self.artifact = artifact
        self.engine = None
        self.plan: dict | None = None  # what runs (runtime/engine/plan.py), once loaded
        self.loop_runner = None  # serving.engine_loop.EngineLoop, once loaded
        self.info: ModelInfo | None = None
        self.token_text: TokenText | None = None
        self.metrics = None
        self.trace = None  # serving.trace.StepTrace with --step-trace
        self.name = artifact.manifest.get("name", "model")
        self.version = str(artifact.manifest.get("version", "0"))
        self.ready = False
        self.load_error: str | None = None
        self.draining = False
        self.created = now()
        self.on_failure = None  # called (from the loader thread) when the model cannot be loaded

    @property
    def engine_error(self) -> str | None:
        """Why a loaded engine can no longer step (a tensor-parallel rank died): then /health is 503."""
        return getattr(getattr(self.engine, "runner", None), "error", None)

    def require_ready(self) -> None:
        if self.draining:
            self.metrics and self.metrics.rejected("draining")
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if self.engine_error:
            raise APIError(503, f"the engine cannot serve: {self.engine_error}", type="service_unavailable",
                           code="engine_failed")
        if not self.ready:
            raise APIError(503, "the model is still loading" if not self.load_error else
                           f"the model failed to load: {self.load_error}", type="service_unavailable",
                           code="not_ready", headers={"Retry-After": "1"})


def _make_server(app, config: ServerConfig, state: State):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, with our own SIGTERM/SIGINT: drain, abort after the grace period, exit 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            if self.should_exit:
                if sig == signal.SIGINT:
                    self.force_exit = True
                return
            begin_shutdown(self, state, config.grace_period, signal.Signals(sig).name)

    ucfg = uvicorn.Config(app, host=config.host, port=config.port, log_level="info", access_log=config.access_log,
                          timeout_graceful_shutdown=config.grace_period + 5, lifespan="on",
                          limit_concurrency=None, timeout_keep_alive=5, http="h11")
    return Server(ucfg)


def begin_shutdown(server, state: State, grace: float, why: str) -> None:
    """Stop accepting, let in-flight requests finish for ``grace`` seconds, then abort what is left."""
    state.draining = True
    runner = state.loop_runner
    inflight = (runner.num_running + runner.num_waiting) if runner else 0
    print(f"infer-run: {why}: stopping; {inflight} request(s) in flight get {grace:g}s to finish", flush=True)
    server.should_exit = True
    if runner is not None:
        timer = threading.Timer(grace, runner.abort_all)
        timer.daemon = True
        timer.start()


def serve(config: ServerConfig, artifact: Artifact) -> int:
    """Serves a verified artifact until SIGTERM; returns the exit code (2 when the model fails to load)."""
    from .app import build_app
    from .metrics import ServerMetrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.tenants is not None:
        config.engine.fairness = config.tenants.fairness()
    state = State(config, artifact)
    state.metrics = ServerMetrics(state.name)
    if config.step_trace:
        from .trace import StepTrace

        try:
            state.trace = StepTrace(config.step_trace)
        except OSError as e:
            print(f"infer-run: error: cannot write the step trace: {e}", file=sys.stderr, flush=True)
            return 2
    app = build_app(state)
    server = _make_server(app, config, state)
    state.on_failure = lambda: setattr(server, "should_exit", True)
    print(f"infer-run: serving {state.name} {state.version} on http://{config.host}:{config.port} "
          f"(loading the model; /health is 503 until it is ready)", flush=True)
    try:
        server.run()
    finally:
        if state.trace is not None:
            state.trace.close()
    if state.load_error:
        return 2
    return 0
