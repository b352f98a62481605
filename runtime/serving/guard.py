"""The outermost ASGI layer: the API key (or a tenant's, with its rate limit) and the body size,
checked before any route runs."""

from __future__ import annotations

import hmac
import json
import math

from .protocol import APIError


class Guard:
    """Outermost ASGI layer: API key, body size by Content-Length. Pure ASGI so streaming is untouched."""

    OPEN_PATHS = {"/health", "/metrics", "/version", "/ping", "/openapi.json"}

    def __init__(self, app, state):
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
        tenants = self.state.config.tenants
        guarded = scope.get("path") not in self.OPEN_PATHS and scope.get("method") != "OPTIONS"
        if tenants is not None and guarded:
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
            tenant = tenants.by_key.get(given)
            if tenant is None and not (key and hmac.compare_digest(given.encode(), key.encode())):
                return await self._error(send, APIError(
                    401, "missing or unknown API key: send a tenant's key as 'Authorization: Bearer KEY'",
                    type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            if tenant is not None:
                scope["infer.tenant"] = tenant.name
                wait = tenant.bucket.take() if tenant.bucket and scope.get("method") == "POST" else 0.0
                if wait:
                    self.state.metrics and self.state.metrics.rejected("rate_limited")
                    return await self._error(send, APIError(
                        429, f"tenant {tenant.name!r} is over its rate of {tenant.rate:g} request(s)/s; "
                        f"retry after {wait:.1f}s", type="rate_limit_error", code="rate_limited",
                        headers={"Retry-After": str(max(1, math.ceil(wait)))}))
            key = None  # checked
        if key and guarded:
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
