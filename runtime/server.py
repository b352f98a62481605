"""``infer-run ARTIFACT``: an OpenAI-compatible HTTP server over the engine.

The engine is synchronous; it runs in its own thread (``EngineLoop``), which takes commands (add,
abort) from a queue between steps, steps while there is work, and hands each output to its request
handler's asyncio queue with ``loop.call_soon_threadsafe``. The engine thread never waits on a
client: a slow reader only lets its own queue grow, and the batch keeps stepping.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus), ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (what
lm-eval's remote tokenizer asks for), ``/version``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import (APIError, GenRequest, ModelInfo, TokenText, chat_logprobs, completion_logprobs, new_id, now,
                       parse_chat, parse_completion, parse_json_body, usage)

log = logging.getLogger("infer.server")

DEFAULT_MAX_BODY = 32 << 20


# ============================================================================== engine thread
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

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, metrics, log_requests: bool = False):
        self.engine = engine
        self.loop = loop
        self.metrics = metrics
        self.log_requests = log_requests
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

    def add(self, rid: str, prompt_ids: list[int], params, queue: asyncio.Queue, arrival: float) -> None:
        with self._lock:
            self._pending_adds += 1
        self._cmds.append(("add", rid, prompt_ids, params, queue, arrival))
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
                "preemptions": e.scheduler.num_preemptions, "steps": e.stats.get("steps", 0)}

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
                _, rid, ids, params, queue, arrival = cmd
                try:
                    self.engine.add_request(rid, ids, params)
                    self._tracks[rid] = _Track(rid, queue, arrival, len(ids))
                except Exception as e:  # validated before, so this is rare: hand it to the handler
                    self._deliver(queue, e)
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
            self._deliver(track.queue, (out, self._finished(track, out, time.monotonic())))

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
                self._wake.wait(0.5)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # an engine bug must not take the server down: fail the requests in flight
                log.exception("engine step failed; aborting %d request(s)", len(self._tracks))
                self.error = e
                for rid, track in list(self._tracks.items()):
                    self._tracks.pop(rid, None)
                    with contextlib.suppress(Exception):
                        engine.abort_request(rid)
                    self._deliver(track.queue, RuntimeError(f"engine error: {type(e).__name__}: {e}"))
                continue
            at = time.monotonic()
            for out in outputs:
                track = self._tracks.get(out.request_id)
                if track is None:
                    continue
                self._account(track, out, at)
                if out.finished:
                    del self._tracks[out.request_id]
                    self._deliver(track.queue, (out, self._finished(track, out, at)))
                else:
                    self._deliver(track.queue, (out, None))


# ============================================================================== server state
@dataclass
class ServerConfig:
    artifact: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256
    log_requests: bool = False
    grace_period: float = 30.0
    max_body: int = DEFAULT_MAX_BODY
    engine_args: dict = field(default_factory=dict)
    access_log: bool = False


class State:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine = None
        self.loop_runner: EngineLoop | None = None
        self.info: ModelInfo | None = None
        self.token_text: TokenText | None = None
        self.metrics = None
        self.name = "?"
        self.version = "?"
        self.ready = False
        self.load_error: str | None = None
        self.draining = False
        self.created = now()
        self.on_failure = None  # called (from the loader thread) when the model cannot be loaded

    def require_ready(self) -> None:
        if self.draining:
            self.metrics and self.metrics.rejected("draining")
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if not self.ready:
            raise APIError(503, "the model is still loading" if not self.load_error else
                           f"the model failed to load: {self.load_error}", type="service_unavailable",
                           code="not_ready", headers={"Retry-After": "1"})


def _load(state: State, loop: asyncio.AbstractEventLoop) -> None:
    """Loader thread: builds the engine, then starts its loop; /health turns ready at the end."""
    from .engine import EngineConfig, LLMEngine

    try:
        t0 = time.monotonic()
        engine = LLMEngine(state.config.artifact, EngineConfig(**state.config.engine_args))
        state.engine = engine
        state.info = ModelInfo(state.name, state.version, engine.max_request_tokens, engine.model.config.vocab_size,
                               engine.tokenizer)
        state.token_text = TokenText(engine.tokenizer)
        runner = EngineLoop(engine, loop, state.metrics, state.config.log_requests)
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


# ============================================================================== ASGI guard
class Guard:
    """Outermost ASGI layer: API key, body size by Content-Length. Pure ASGI so streaming is untouched."""

    OPEN_PATHS = {"/health", "/metrics", "/version", "/ping"}

    def __init__(self, app, state: State):
        self.app = app
        self.state = state

    async def _error(self, send, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.state.config.api_key
        if key and scope.get("path") not in self.OPEN_PATHS and scope.get("method") != "OPTIONS":
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), key.encode()):
                return await self._error(send, APIError(
                    401, "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
                    type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.state.config.max_body
            except ValueError:
                return await self._error(send, APIError(400, "bad Content-Length header", code="bad_request"))
            if too_big:
                return await self._error(send, APIError(
                    413, f"the request body is {length} bytes, over the limit of {self.state.config.max_body}",
                    code="request_too_large"))
        return await self.app(scope, receive, send)


# ============================================================================== the app
def build_app(state: State):

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        loader = threading.Thread(target=_load, args=(state, loop), name="infer-loader", daemon=True)
        loader.start()
        yield
        if state.loop_runner is not None:
            state.loop_runner.stop()

    app = FastAPI(title="infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return error_response(APIError(exc.status_code, str(exc.detail), type="invalid_request_error",
                                       code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return error_response(APIError(400, str(exc)[:500]))

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    async def read_body(request: Request) -> dict:
        limit = state.config.max_body
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
        except APIError:
            raise
        except Exception:  # the client went away while sending
            raise APIError(400, "the request body could not be read", code="bad_request") from None
        return parse_json_body(b"".join(chunks))

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if state.ready and not state.draining:
            return {"status": "ok"}
        status = "draining" if state.draining else ("failed" if state.load_error else "loading")
        return JSONResponse({"status": status, **({"error": state.load_error} if state.load_error else {})},
                            status_code=503)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError, version as pkg_version
        try:
            v = pkg_version("infer")
        except PackageNotFoundError:
            v = "unknown"
        return {"version": v, "model": state.name, "model_version": state.version}

    @app.get("/metrics")
    async def metrics():
        from .metrics import CONTENT_TYPE
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": state.name, "object": "model", "created": state.created, "owned_by": "infer",
                "root": state.name, "parent": None, "version": state.version,
                "max_model_len": state.info.max_request_tokens if state.info else None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in {state.name, f"{state.name}-{state.version}", f"{state.name}:{state.version}"}:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_card()

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        state.require_ready()
        tok = state.engine.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.eos_token, "eos_token_ids": list(tok.eos_token_ids),
                "chat_template": tok.chat_template, "model_max_length": state.info.max_request_tokens,
                "vocab_size": state.info.vocab_size}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        state.require_ready()
        body = await read_body(request)
        tok = state.engine.tokenizer
        add_special = body.get("add_special_tokens", False)
        if not isinstance(add_special, bool):
            raise APIError(400, "add_special_tokens must be true or false", param="add_special_tokens")
        if "messages" in body:
            from .protocol import chat_messages
            try:
                text = tok.apply_chat_template(chat_messages(body["messages"]),
                                               add_generation_prompt=body.get("add_generation_prompt", True) is not False)
            except APIError:
                raise
            except Exception as e:
                raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
        ids = tok.encode(text, add_special_tokens=add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.info.max_request_tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state.require_ready()
        body = await read_body(request)
        ids = body.get("tokens")
        vocab = state.info.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": state.engine.tokenizer.decode(ids, skip_special_tokens=False)}

    # ------------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(request: Request):
        state.require_ready()
        body = await read_body(request)
        return await generate(request, parse_completion(body, state.info))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.require_ready()
        body = await read_body(request)
        return await generate(request, parse_chat(body, state.info))

    async def generate(request: Request, req: GenRequest):
        runner = state.loop_runner
        mq = state.config.max_queue
        waiting = runner.num_waiting
        if mq >= 0 and waiting > 0 and waiting + req.num_choices > mq:
            state.metrics.rejected("queue_full")
            raise APIError(429, f"the server is overloaded: {waiting} request(s) already waiting "
                           f"(--max-queue {mq}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(retry_after(waiting))})
        rid = new_id(req.kind)
        arrival = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        sub_ids = [f"{rid}-{i}" for i in range(req.num_choices)]
        for i, sub in enumerate(sub_ids):
            runner.add(sub, req.prompts[i // req.n], req.params[i], queue, arrival)
        if state.config.log_requests:
            log.info("request %s: %s prompts=%r params=%r", rid, req.kind, req.prompt_texts, req.params[0])
        else:
            log.debug("request %s: %s, %d choice(s)", rid, req.kind, req.num_choices)
        ctx = _Gen(state, req, rid, sub_ids, queue)
        if req.stream:
            return StreamingResponse(ctx.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await ctx.collect(request)
        if result is None:  # the client went away; its requests were aborted
            return Response(status_code=499)
        return JSONResponse(result)

    def retry_after(waiting: int) -> int:
        m = state.metrics
        mean = m.e2e_sum / m.e2e_n if m.e2e_n else 1.0  # mean end-to-end latency so far
        per_slot = waiting / max(1, state.engine.config.max_num_seqs)
        return int(max(1, min(60, round(mean * max(1.0, per_slot)))))

    return Guard(app, state)


class _Gen:
    """One HTTP request's view of its engine requests: gathers outputs, builds the response or stream."""

    def __init__(self, state: State, req: GenRequest, rid: str, sub_ids: list[str], queue: asyncio.Queue):
        self.state = state
        self.req = req
        self.rid = rid
        self.sub_ids = sub_ids
        self.index = {s: i for i, s in enumerate(sub_ids)}
        self.queue = queue
        self.created = now()
        self.final: dict[int, tuple] = {}
        self.done = False

    def abort_unfinished(self) -> None:
        runner = self.state.loop_runner
        for sub, i in self.index.items():
            if i not in self.final:
                runner.abort(sub)

    async def _next(self):
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def _usage(self) -> dict:
        req = self.req
        prompt = sum(len(p) for p in req.prompts)
        completion = 0 if req.discard_output else sum(len(o.token_ids) for o, _ in self.final.values())
        cached = sum(f.num_cached_tokens for _, f in self.final.values() if f) // max(1, req.n)
        return usage(prompt, completion, cached)

    def _text_and_logprobs(self, out, i: int, prompt_part: bool, start_tok: int, end_tok: int, text: str):
        """Builds a choice's text and logprobs for tokens [start_tok, end_tok) of the output (plus the prompt)."""
        req, tt = self.req, self.state.token_text
        pidx = i // req.n
        entries = []
        prefix = ""
        if prompt_part and req.echo:
            ptxt = req.prompt_texts[pidx]
            prefix = ptxt if ptxt is not None else self.state.engine.tokenizer.decode(req.prompts[pidx])
            if req.logprobs is not None:
                plp = out.prompt_logprobs or []
                entries += [(t, plp[k] if k < len(plp) else None) for k, t in enumerate(req.prompts[pidx])]
        if req.discard_output:
            text = ""
            end_tok = start_tok
        if req.logprobs is not None and out.logprobs is not None:
            lps = out.logprobs
            entries += [(out.token_ids[k], lps[k] if k < len(lps) else None) for k in range(start_tok, end_tok)]
        lp = None
        if req.logprobs is not None:
            if req.kind == "chat":
                lp = chat_logprobs(entries, tt)
            else:
                base = 0 if req.echo else len(req.prompt_texts[pidx] or "")
                lp = completion_logprobs(entries, tt, base)
        return prefix + text, lp

    # ------------------------------------------------------------------ not streaming
    async def collect(self, request) -> dict:
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while len(self.final) < len(self.sub_ids):
                getter = asyncio.ensure_future(self._next())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return None
                out, fin = getter.result()
                if out.finished:
                    self.final[self.index[out.request_id]] = (out, fin)
        finally:
            watcher.cancel()
            self.abort_unfinished()
        self._log_outputs()
        choices = []
        for i in range(len(self.sub_ids)):
            out, fin = self.final[i]
            text, lp = self._text_and_logprobs(out, i, True, 0, len(out.token_ids), out.text)
            c = {"index": i, "logprobs": lp, "finish_reason": out.finish_reason}
            if self.req.kind == "chat":
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            c["metrics"] = fin.as_dict() if fin else None
            choices.append(c)
        return {"id": self.rid, "object": "chat.completion" if self.req.kind == "chat" else "text_completion",
                "created": self.created, "model": self.state.name, "choices": choices, "usage": self._usage(),
                "system_fingerprint": f"infer-{self.state.version}"}

    def _log_outputs(self) -> None:
        if self.state.config.log_requests:
            for i, (out, _) in sorted(self.final.items()):
                log.info("request %s choice %d (%s): %r", self.rid, i, out.finish_reason, out.text)

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choices: list[dict], **extra) -> str:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.req.kind == "chat" else "text_completion",
               "created": self.created, "model": self.state.name, "choices": choices, **extra}
        if self.req.include_usage and "usage" not in obj:
            obj["usage"] = None
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(self):
        req = self.req
        chat = req.kind == "chat"
        emitted = [0] * len(self.sub_ids)  # tokens already sent per choice
        started = [False] * len(self.sub_ids)
        try:
            if chat:
                yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None} for i in range(len(self.sub_ids))])
                started = [True] * len(self.sub_ids)
            while len(self.final) < len(self.sub_ids):
                items = [await self._next()]
                while not self.queue.empty():  # a slow reader gets what piled up as one chunk per choice
                    nxt = self.queue.get_nowait()
                    if isinstance(nxt, Exception):
                        raise nxt
                    items.append(nxt)
                merged: dict[int, list] = {}
                for out, fin in items:
                    i = self.index[out.request_id]
                    if i in merged:
                        merged[i][1] += out.delta_text
                        merged[i][0], merged[i][2] = out, fin
                    else:
                        merged[i] = [out, out.delta_text, fin]
                choices, finals = [], []
                for i, (out, text, fin) in sorted(merged.items()):
                    first = not started[i]
                    started[i] = True
                    end = len(out.token_ids)
                    text, lp = self._text_and_logprobs(out, i, first, emitted[i], end, text)
                    emitted[i] = end
                    if out.finished:
                        self.final[i] = (out, fin)
                    if chat:
                        if text or lp:
                            choices.append({"index": i, "delta": {"content": text}, "logprobs": lp,
                                            "finish_reason": None})
                        if out.finished:  # its own chunk, after the last content, as OpenAI sends it
                            c = {"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason}
                            c["metrics"] = fin.as_dict() if fin else None
                            finals.append(c)
                    elif text or lp or out.finished:
                        c = {"index": i, "text": text, "logprobs": lp,
                             "finish_reason": out.finish_reason if out.finished else None}
                        if out.finished:
                            c["metrics"] = fin.as_dict() if fin else None
                        choices.append(c)
                if choices:
                    yield self._chunk(choices)
                if finals:
                    yield self._chunk(finals)
            if req.include_usage:
                yield self._chunk([], usage=self._usage())
            self._log_outputs()
            yield "data: [DONE]\n\n"
        except (RuntimeError, ValueError) as e:  # an engine failure mid-stream: say so in-band, then end
            log.error("request %s failed: %s", self.rid, e)
            yield f"data: {json.dumps(APIError(500, str(e), type='server_error').body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also runs when the client disconnects (the generator is cancelled)
            self.abort_unfinished()


async def _wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ============================================================================== uvicorn
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


def serve(args) -> int:
    """Entry point from ``infer-run ARTIFACT`` without ``--prompt``."""
    from .artifact import verify_artifact
    from .cli import engine_args
    from .metrics import ServerMetrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    artifact = verify_artifact(args.artifact)  # a bad artifact fails here, before listening (exit 2)
    config = ServerConfig(artifact=str(args.artifact), host=args.host, port=args.port, api_key=args.api_key,
                          max_queue=args.max_queue, log_requests=args.log_requests, grace_period=args.grace_period,
                          max_body=args.max_body, engine_args=engine_args(args), access_log=args.access_log)
    state = State(config)
    state.name = artifact.manifest.get("name", "model")
    state.version = str(artifact.manifest.get("version", "0"))
    state.metrics = ServerMetrics(state.name)
    app = build_app(state)
    server = _make_server(app, config, state)
    state.on_failure = lambda: setattr(server, "should_exit", True)
    print(f"infer-run: serving {state.name} {state.version} on http://{config.host}:{config.port} "
          f"(loading the model; /health is 503 until it is ready)", flush=True)
    server.run()
    if state.load_error:
        return 2
    return 0
