"""The router in front of infer-run replicas: prefix-aware choice balanced against load, health
checks, retries of requests nothing was sent back for yet, and an SSE error event when a stream's
replica dies.

Policy (``prefix``, the default): the request's text (the prompt, or the chat messages' roles and
contents) is cut into blocks of ``BLOCK_CHARS`` characters and hashed as a chain, each block's hash
covering everything before it, as the engine's prefix cache hashes token blocks. Every replica keeps
an LRU set of the chains it was sent (``cache_blocks`` of them, sized like its KV cache). A request
goes to the replica matching most of its leading blocks when that covers at least ``threshold`` of
them and that replica has no more than ``balance`` requests in flight beyond the least busy one;
otherwise to the least busy replica (fewest cached blocks on a tie, so new prefixes spread out).
``round_robin`` ignores prefixes (the baseline in bench/replicas.py).

Faults: a replica that cannot be reached, or fails (5xx, a dropped connection) before anything was
sent back, is marked down and the request retried on another; a stream that breaks after it began
ends with an SSE ``error`` event (type ``server_error``, code ``replica_failed``: retry it) and
``[DONE]``. With no replica up: 503 with Retry-After. A replica comes back when ``/health`` says ok.

Measured against vllm-router's ``cache_aware`` (docs/replicas.md): its policy is the same idea and
worked with infer-run's API, but a replica killed under load gave its in-flight requests a 500
without retry, new requests kept going to it until its health checks failed, and broken streams
ended without an error event; those are this file's reason to exist.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
import json
import logging
import time

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("infer.router")
BLOCK_CHARS = 256  # about 64 tokens of English text: the router's prefix block
POLICIES = ("prefix", "round_robin")
_RETRIABLE = {502, 503, 504}


def prefix_chain(text: str) -> list[bytes]:
    """Hashes of the text's full blocks, each covering all before it (the prefix cache's chain, on text)."""
    out, h = [], b""
    for i in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hashlib.blake2b(h + text[i:i + BLOCK_CHARS].encode(), digest_size=16).digest()
        out.append(h)
    return out


def request_text(body: dict) -> str:
    if "messages" in body and isinstance(body["messages"], list):
        return "".join(f"{m.get('role')}\x00{m.get('content')}\x00" for m in body["messages"] if isinstance(m, dict))
    p = body.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)


class Backend:
    def __init__(self, url: str, cache_blocks: int):
        self.url = url.rstrip("/")
        self.inflight = 0
        self.healthy = False
        self.draining = False  # no new requests (a rolling upgrade takes it out)
        self.cache: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.cache_blocks = cache_blocks
        self.sent = 0

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def matched(self, chain: list[bytes]) -> int:
        n = 0
        for h in chain:
            if h not in self.cache:
                break
            n += 1
        return n

    def remember(self, chain: list[bytes]) -> None:
        for h in chain:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)


class Router:
    def __init__(self, urls: list[str], policy: str = "prefix", threshold: float = 0.5, balance: int = 4,
                 cache_blocks: int = 4096, health_interval: float = 1.0, timeout: float = 600.0):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.backends = [Backend(u, cache_blocks) for u in urls]
        self.policy, self.threshold, self.balance = policy, threshold, balance
        self.health_interval = health_interval
        self.rr = itertools.count()
        self.client: httpx.AsyncClient | None = None
        self.timeout = timeout
        self.stats = {"requests": 0, "retries": 0, "stream_errors": 0, "prefix_routed": 0}

    def backend(self, url: str) -> Backend:
        url = url.rstrip("/")
        for b in self.backends:
            if b.url == url:
                return b
        raise KeyError(url)

    def add(self, url: str, cache_blocks: int = 4096) -> Backend:
        try:
            return self.backend(url)
        except KeyError:
            b = Backend(url, cache_blocks)
            self.backends.append(b)
            return b

    def mark_down(self, url: str) -> None:
        self.backend(url).healthy = False

    def choose(self, chain: list[bytes], exclude: set[str]) -> Backend | None:
        ups = [b for b in self.backends if b.usable and b.url not in exclude]
        if not ups:
            return None
        if self.policy == "round_robin":
            return ups[next(self.rr) % len(ups)]
        least = min(ups, key=lambda b: (b.inflight, len(b.cache)))
        if chain:
            best = max(ups, key=lambda b: (b.matched(chain), -b.inflight))
            if (best.matched(chain) >= self.threshold * len(chain) and best.matched(chain) > 0
                    and best.inflight <= least.inflight + self.balance):
                self.stats["prefix_routed"] += 1
                return best
        return least

    async def check_health(self) -> None:
        async def one(b: Backend):
            try:
                ok = (await self.client.get(f"{b.url}/health", timeout=2)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok != b.healthy:
                log.warning("replica %s is %s", b.url, "up" if ok else "down")
            b.healthy = ok

        while True:
            await asyncio.gather(*(one(b) for b in list(self.backends)))
            await asyncio.sleep(self.health_interval)

    # ------------------------------------------------------------------ forwarding
    async def forward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        chain = prefix_chain(request_text(body)) if self.policy == "prefix" else []
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key",
                                                                             "content-type")}
        self.stats["requests"] += 1
        tried: set[str] = set()
        while True:
            b = self.choose(chain, tried)
            if b is None:
                return _unavailable("no replica is up" if not tried else
                                    f"every replica failed this request ({len(tried)} tried)")
            tried.add(b.url)
            b.remember(chain)
            b.sent += 1
            b.inflight += 1
            req = self.client.build_request(request.method, f"{b.url}{request.url.path}", content=raw,
                                            headers=headers, timeout=httpx.Timeout(self.timeout, connect=5))
            try:
                up = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                b.inflight -= 1
                self._failed(b, e)
                continue
            if up.status_code in _RETRIABLE:
                await up.aclose()
                b.inflight -= 1
                self.stats["retries"] += 1
                continue
            if body.get("stream") and up.status_code == 200:
                return StreamingResponse(self._relay(b, up), status_code=200, headers=_passed(up.headers),
                                         media_type="text/event-stream")
            try:
                content = await up.aread()
            except httpx.HTTPError as e:  # died before the reply was complete: nothing sent back yet
                self._failed(b, e)
                continue
            finally:
                b.inflight -= 1
                await up.aclose()
            return Response(content, status_code=up.status_code, headers=_passed(up.headers))

    def _failed(self, b: Backend, e: Exception) -> None:
        log.warning("replica %s failed a request (%s: %s); retrying elsewhere", b.url, type(e).__name__, e)
        b.healthy = False  # the health check brings it back
        self.stats["retries"] += 1

    async def _relay(self, b: Backend, up: httpx.Response):
        try:
            async for chunk in up.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            b.healthy = False
            self.stats["stream_errors"] += 1
            log.warning("replica %s broke a stream (%s); ending it with an error event", b.url, type(e).__name__)
            err = {"error": {"message": f"the replica serving this stream failed ({type(e).__name__}); retry the "
                                        f"request", "type": "server_error", "param": None, "code": "replica_failed"}}
            yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            b.inflight -= 1
            await up.aclose()

    async def passthrough_get(self, request: Request) -> Response:
        for b in [b for b in self.backends if b.usable]:
            try:
                r = await self.client.get(f"{b.url}{request.url.path}", headers=dict(request.headers), timeout=10)
                return Response(r.content, status_code=r.status_code, headers=_passed(r.headers))
            except httpx.HTTPError:
                continue
        return _unavailable("no replica is up")

    async def health(self, request: Request) -> Response:
        up = sum(b.usable for b in self.backends)
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas_up": up,
                             "replicas": len(self.backends)}, status_code=200 if up else 503)

    async def status(self, request: Request) -> Response:
        return JSONResponse({"policy": self.policy, **self.stats, "replicas": [
            {"url": b.url, "healthy": b.healthy, "draining": b.draining, "inflight": b.inflight, "sent": b.sent,
             "cached_blocks": len(b.cache)} for b in self.backends]})

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))
            health = asyncio.create_task(self.check_health())
            yield
            health.cancel()
            await self.client.aclose()

        routes = [Route("/v1/completions", self.forward, methods=["POST"]),
                  Route("/v1/chat/completions", self.forward, methods=["POST"]),
                  Route("/tokenize", self.forward, methods=["POST"]),
                  Route("/detokenize", self.forward, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/router/status", self.status, methods=["GET"]),
                  Route("/v1/models", self.passthrough_get, methods=["GET"]),
                  Route("/version", self.passthrough_get, methods=["GET"])]
        return Starlette(routes=routes, lifespan=lifespan)


def _passed(headers) -> dict:
    return {k: v for k, v in headers.items() if k.lower() in ("content-type", "retry-after", "cache-control")}


def _unavailable(why: str) -> JSONResponse:
    return JSONResponse({"error": {"message": f"{why}; retry shortly", "type": "service_unavailable", "param": None,
                                   "code": "no_replica"}}, status_code=503, headers={"Retry-After": "1"})
