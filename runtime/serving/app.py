"""The HTTP API: the FastAPI app and its routes, each a plain function of the request.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus), ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (what
lm-eval's remote tokenizer asks for), ``/version``, ``/openapi.json``. A route finds the server's
``State`` on ``request.app.state.server``.

A request body is read here, then parsed, validated and tokenized in a worker thread
(``asyncio.to_thread``): a long prompt or chat template never holds up other requests or ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_loop import load_engine
from .guard import Guard
from .protocol import (APIError, GenRequest, new_id, parse_chat, parse_completion, parse_detokenize, parse_json_body,
                       parse_tokenize, request_body_schemas)
from .responses import Generation

log = logging.getLogger("infer.server")


def _state(request: Request):
    return request.app.state.server


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_body(request: Request) -> bytes:
    """The raw body, read in chunks so that one over ``--max-body`` stops at the limit."""
    limit = _state(request).config.max_body
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
    return b"".join(chunks)


async def parsed(request: Request, parse):
    """``parse(json_body, model_info)`` on the body, in a worker thread: JSON decoding, validation,
    chat templating and tokenization all stay off the event loop."""
    state = _state(request)
    state.require_ready()
    raw = await read_body(request)
    return await asyncio.to_thread(lambda: parse(parse_json_body(raw), state.info))


# ------------------------------------------------------------------ plain endpoints
async def health(request: Request):
    state = _state(request)
    error = state.load_error or state.engine_error
    if state.ready and not state.draining and not error:
        return {"status": "ok"}
    status = "draining" if state.draining else ("failed" if error else "loading")
    return JSONResponse({"status": status, **({"error": error} if error else {})}, status_code=503)


async def version(request: Request):
    from importlib.metadata import PackageNotFoundError, version as pkg_version

    state = _state(request)
    try:
        v = pkg_version("infer")
    except PackageNotFoundError:
        v = "unknown"
    return {"version": v, "model": state.name, "model_version": state.version, "plan": state.plan}


async def metrics(request: Request):
    from .metrics import CONTENT_TYPE

    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(state) -> dict:
    return {"id": state.name, "object": "model", "created": state.created, "owned_by": "infer",
            "root": state.name, "parent": None, "version": state.version,
            "max_model_len": state.info.max_request_tokens if state.info else None}


async def models(request: Request):
    return {"object": "list", "data": [_model_card(_state(request))]}


async def model(request: Request, model_id: str):
    state = _state(request)
    if model_id not in {state.name, f"{state.name}-{state.version}", f"{state.name}:{state.version}"}:
        raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
    return _model_card(state)


async def tokenizer_info(request: Request):
    state = _state(request)
    state.require_ready()
    tok = state.engine.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": tok.eos_token, "eos_token_ids": list(tok.eos_token_ids),
            "chat_template": tok.chat_template, "model_max_length": state.info.max_request_tokens,
            "vocab_size": state.info.vocab_size}


async def tokenize(request: Request):
    return await parsed(request, parse_tokenize)


async def detokenize(request: Request):
    def run(body, info):
        return {"prompt": info.tokenizer.decode(parse_detokenize(body, info), skip_special_tokens=False)}

    return await parsed(request, run)


# ------------------------------------------------------------------ generation
async def completions(request: Request):
    return await generate(request, await parsed(request, parse_completion))


async def chat_completions(request: Request):
    return await generate(request, await parsed(request, parse_chat))


def _retry_after(state, waiting: int) -> int:
    m = state.metrics
    mean = m.e2e_sum / m.e2e_n if m.e2e_n else 1.0  # mean end-to-end latency so far
    per_slot = waiting / max(1, state.engine.config.max_num_seqs)
    return int(max(1, min(60, round(mean * max(1.0, per_slot)))))


async def generate(request: Request, req: GenRequest):
    """Queues a parsed request's sequences. They count against ``--max-queue`` together (one
    request never fans out past it: protocol refuses that with a 400); an idle server takes any."""
    state = _state(request)
    runner = state.loop_runner
    mq = state.config.max_queue
    waiting = runner.num_waiting
    if mq >= 0 and waiting > 0 and waiting + req.num_choices > mq:
        state.metrics.rejected("queue_full")
        raise APIError(429, f"the server is overloaded: {waiting} request(s) already waiting "
                       f"(--max-queue {mq}); retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(_retry_after(state, waiting))})
    rid = new_id(req.kind)
    arrival = time.monotonic()
    if req.constrained:
        state.metrics.constrained(req.constrained)
    queue: asyncio.Queue = asyncio.Queue()
    sub_ids = [f"{rid}-{i}" for i in range(req.num_choices)]
    for i, sub in enumerate(sub_ids):
        runner.add(sub, req.prompts[i // req.n], req.params[i], queue, arrival, req.priority,
                   request.scope.get("infer.tenant", ""))
    if state.config.log_requests:
        log.info("request %s: %s prompts=%r params=%r", rid, req.kind, req.prompt_texts, req.params[0])
    else:
        log.debug("request %s: %s, %d choice(s)", rid, req.kind, req.num_choices)
    gen = Generation(state, req, rid, sub_ids, queue)
    if req.stream:
        return StreamingResponse(gen.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await gen.collect(request)
    if result is None:  # the client went away; its requests were aborted
        return Response(status_code=499)
    return JSONResponse(result)


ROUTES = [("/health", health, "GET"), ("/ping", health, "GET"), ("/version", version, "GET"),
          ("/metrics", metrics, "GET"), ("/v1/models", models, "GET"), ("/v1/models/{model_id:path}", model, "GET"),
          ("/tokenizer_info", tokenizer_info, "GET"), ("/tokenize", tokenize, "POST"),
          ("/detokenize", detokenize, "POST"), ("/v1/completions", completions, "POST"),
          ("/v1/chat/completions", chat_completions, "POST")]


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERROR_RESPONSES = {status: {"description": why, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
                   for status, why in [(400, "invalid request: param names the field, the message the allowed range"),
                                       (401, "missing or wrong API key"), (404, "unknown path or model"),
                                       (413, "body over --max-body"), (429, "over --max-queue; see Retry-After"),
                                       (503, "loading or shutting down")]}


def openapi_schema(app: FastAPI, state) -> dict:
    """FastAPI's schema of the routes, with each POST body described from protocol's bounds (the
    loaded model's limits included, so it is cached only once the model is loaded)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title="infer", version=state.version, routes=app.routes,
                         description=f"OpenAI-compatible API serving {state.name} {state.version}. Every bound "
                                     f"on a request body is listed here; past one, a 400 names the field.")
    for path, body in request_body_schemas(state.info).items():
        schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                        "content": {"application/json": {"schema": body}}}
    schema["paths"]["/v1/models/{model_id}"]["get"]["responses"].pop("422", None)  # bad input is a 400 here
    if state.info is not None:
        app.openapi_schema = schema
    return schema


def build_app(state):
    """The ASGI app serving ``state`` (a server.State): the routes behind the Guard."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        loader = threading.Thread(target=load_engine, args=(state, loop), name="infer-loader", daemon=True)
        loader.start()
        lag = None
        if state.trace is not None:
            from .trace import sample_loop_lag

            lag = asyncio.create_task(sample_loop_lag(state.trace))
        yield
        if lag is not None:
            lag.cancel()
        if state.loop_runner is not None:
            state.loop_runner.stop()
        if state.engine is not None:
            state.engine.close()  # a sharded artifact's other ranks

    app = FastAPI(title="infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    for path, fn, method in ROUTES:
        app.add_api_route(path, fn, methods=[method], responses=ERROR_RESPONSES)
    app.openapi = lambda: openapi_schema(app, state)

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

    return Guard(app, state)
