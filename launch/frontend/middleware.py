"""ASGI middleware of the HTTP front: the API key check (`ApiKey`) and vLLM's X-Request-Id response header
(`RequestId`, serve.py's --enable-request-id-headers); `route_path`, a request's path as the routes see it. The access
log's middleware is launch/frontend/access_log.py's."""
from __future__ import annotations

import secrets
import uuid

from fastapi.responses import JSONResponse

from .protocol import APIError


def route_path(scope) -> str:
    """The request's path as the routes see it: without the --root-path prefix uvicorn puts in front of it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class ApiKey:
    """ASGI middleware: with --api-key, every path but OPEN answers 401 unless the request carries the key, before
    its body is read (a malformed body without the key is a 401, as vLLM's check, not a 400)."""

    OPEN = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                      "/redoc"})

    def __init__(self, app, key: str):
        self.app, self.want, self.key = app, f"Bearer {key}".encode(), key.encode()

    async def __call__(self, scope, receive, send):
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        if scope["type"] != "http" or route_path(scope) in self.OPEN or secrets.compare_digest(
                headers.get(b"authorization", b""), self.want) or secrets.compare_digest(
                headers.get(b"x-api-key", b"") or b"\0", self.key):      # Anthropic's clients send the key so
            return await self.app(scope, receive, send)
        err = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' (or "
                            "'x-api-key: <key>')", code="invalid_api_key")
        if (rec := scope.get("state", {}).get("access")) is not None:
            rec.error = err.message
        await JSONResponse(err.body(), status_code=401)(scope, receive, send)


class RequestId:
    """ASGI middleware (vLLM's --enable-request-id-headers): every answer carries an X-Request-Id header, the
    request's own when it sent one, else a new one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", sent)]}
            await send(message)
        await self.app(scope, receive, send_with_id)
