"""The ASGI middleware in front of every route: the API key and the request-body bound.

    app = Guard(app, api_key="secret", open_paths={"/health"}, max_body_bytes=4 << 20)

- With an API key, every path but `open_paths` needs `Authorization: Bearer KEY` (or `x-api-key: KEY`); the key is
  compared in constant time (hmac.compare_digest), so its bytes cannot be guessed from response timings.
- A body longer than `max_body_bytes` is a 413: at once when Content-Length says so, else (chunked uploads) as
  soon as the bytes received pass the bound, which raises BodyTooLarge inside the route's body read.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware): streamed responses and disconnects pass through it
untouched.
"""
from __future__ import annotations

import hmac
from typing import Callable

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import error_body


class BodyTooLarge(HTTPException):
    """The request body passed the server's bound (an HTTPException, so that FastAPI's body parsing lets it
    through to the app's handler: a 413)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(start the server with a larger --max-body-bytes)")


class Guard:
    def __init__(self, app, *, api_key: str | None, open_paths: set[str], max_body_bytes: int,
                 on_refused: Callable[[], None] = lambda: None):
        self.app, self.open_paths, self.max_body_bytes, self.on_refused = app, open_paths, max_body_bytes, on_refused
        self.key = api_key.encode() if api_key else None

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = None
        for name, value in headers:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and given is None:
                given = value.strip()
        return given is not None and hmac.compare_digest(given, self.key)

    async def _refuse(self, scope, receive, send, status: int, message: str, type_: str) -> None:
        self.on_refused()
        await JSONResponse(error_body(status, message, type_), status_code=status)(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        if self.key is not None and scope["path"] not in self.open_paths and not self._authorized(headers):
            return await self._refuse(scope, receive, send, 401, "invalid or missing API key (send "
                                      "Authorization: Bearer <key>)", "authentication_error")
        limit = self.max_body_bytes
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None:
            if not length.strip().isdigit():
                return await self._refuse(scope, receive, send, 400, f"invalid Content-Length {length[:40]!r}",
                                          "invalid_request_error")
            if int(length) > limit:
                return await self._refuse(scope, receive, send, 413, BodyTooLarge(limit).detail,
                                          "invalid_request_error")
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, bounded_receive, send)
