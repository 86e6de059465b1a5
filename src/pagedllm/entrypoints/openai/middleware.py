"""ASGI middleware of the server: the request body limit, the API key check, X-Request-Id headers."""
from __future__ import annotations

import logging
import secrets
import uuid
from typing import Any

from pagedllm.entrypoints.openai.serving_engine import error_response

logger = logging.getLogger("pagedllm")


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``: at once from Content-Length, else while a
    chunked body arrives (it is read here, at most ``max_bytes`` of it, then handed on), so one
    client cannot make the server read and parse an unbounded body."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body was whole
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, size)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any, size: int) -> None:
        response = error_response(413, f"the request body is larger than this server accepts ({size} > "
                                       f"{self.max_bytes} bytes; --max-request-body-bytes)")
        await response(scope, receive, send)


class APIKeyMiddleware:
    """401 on /v1/* without 'Authorization: Bearer KEY'. Plain ASGI (not BaseHTTPMiddleware),
    so handlers still see the client's disconnect."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        # CORS preflights carry no credentials (vLLM lets them through too).
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and _route_path(scope).startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "Invalid or missing API key (Authorization: Bearer ...)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route_path(scope: dict) -> str:
    """The path the routes see: without a --root-path prefix that the proxy left in place."""
    path, root = scope["path"], scope.get("root_path") or ""
    if root and (path == root or path.startswith(root.rstrip("/") + "/")):
        return path[len(root.rstrip("/")):] or "/"
    return path


class RequestIdMiddleware:
    """An X-Request-Id header on every response: the client's, or a new one, which is also put on
    the request so that it names the engine request (`cmpl-<id>`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id")
        if not request_id:
            request_id = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*scope["headers"], (b"x-request-id", request_id)]}

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
