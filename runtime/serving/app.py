"""The HTTP API: the FastAPI app and its routes, each a plain function of the request.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus), ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (what
lm-eval's remote tokenizer asks for), ``/version``. A route finds the server's ``State`` on
``request.app.state.server``.
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
from .protocol import APIError, GenRequest, chat_messages, new_id, parse_chat, parse_completion, parse_json_body
from .responses import Generation

log = logging.getLogger("infer.server")


def _state(request: Request):
    return request.app.state.server


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_body(request: Request) -> dict:
    """The JSON body, read in chunks so that one over ``--max-body`` stops at the limit."""
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
    return parse_json_body(b"".join(chunks))


# ------------------------------------------------------------------ plain endpoints
async def health(request: Request):
    state = _state(request)
    if state.ready and not state.draining:
        return {"status": "ok"}
    status = "draining" if state.draining else ("failed" if state.load_error else "loading")
    return JSONResponse({"status": status, **({"error": state.load_error} if state.load_error else {})},
                        status_code=503)


async def version(request: Request):
    from importlib.metadata import PackageNotFoundError, version as pkg_version

    state = _state(request)
    try:
        v = pkg_version("infer")
    except PackageNotFoundError:
        v = "unknown"
    return {"version": v, "model": state.name, "model_version": state.version, "kernels": state.kernels}


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
    state = _state(request)
    state.require_ready()
    body = await read_body(request)
    tok = state.engine.tokenizer
    add_special = body.get("add_special_tokens", False)
    if not isinstance(add_special, bool):
        raise APIError(400, "add_special_tokens must be true or false", param="add_special_tokens")
    if "messages" in body:
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


async def detokenize(request: Request):
    state = _state(request)
    state.require_ready()
    body = await read_body(request)
    ids = body.get("tokens")
    vocab = state.info.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                            for t in ids):
        raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
    return {"prompt": state.engine.tokenizer.decode(ids, skip_special_tokens=False)}


# ------------------------------------------------------------------ generation
async def completions(request: Request):
    state = _state(request)
    state.require_ready()
    body = await read_body(request)
    return await generate(request, parse_completion(body, state.info))


async def chat_completions(request: Request):
    state = _state(request)
    state.require_ready()
    body = await read_body(request)
    return await generate(request, parse_chat(body, state.info))


def _retry_after(state, waiting: int) -> int:
    m = state.metrics
    mean = m.e2e_sum / m.e2e_n if m.e2e_n else 1.0  # mean end-to-end latency so far
    per_slot = waiting / max(1, state.engine.config.max_num_seqs)
    return int(max(1, min(60, round(mean * max(1.0, per_slot)))))


async def generate(request: Request, req: GenRequest):
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
    queue: asyncio.Queue = asyncio.Queue()
    sub_ids = [f"{rid}-{i}" for i in range(req.num_choices)]
    for i, sub in enumerate(sub_ids):
        runner.add(sub, req.prompts[i // req.n], req.params[i], queue, arrival)
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


def build_app(state):
    """The ASGI app serving ``state`` (a server.State): the routes behind the Guard."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        loader = threading.Thread(target=load_engine, args=(state, loop), name="infer-loader", daemon=True)
        loader.start()
        yield
        if state.loop_runner is not None:
            state.loop_runner.stop()

    app = FastAPI(title="infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    for path, fn, method in ROUTES:
        app.add_api_route(path, fn, methods=[method])

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
