"""How the server answers what goes wrong: every error is a JSON body in OpenAI's shape
({"error": {"message", "type", "param", "code"}}, protocol.error_body), 4xx for the client's fault (naming the
field), 5xx for the server's; a client that hung up gets nothing (499 in the logs)."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import ApiError, error_body, validation_message

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection before its response was ready (its engine requests were aborted)."""


def refused(e: Exception) -> ApiError:
    """The engine's RequestError as the HTTP error: 400, or 503 when it is about load (GrammarBusy)."""
    from ..runtime.grammar import GrammarBusy

    if isinstance(e, GrammarBusy):
        return ApiError(503, str(e), type_="overloaded_error")
    return ApiError(400, str(e))


def install_error_handlers(app: FastAPI, on_bad_request) -> None:
    """The app's exception handlers; `on_bad_request()` counts each 4xx (the metrics)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status < 500:
            on_bad_request()
        return JSONResponse(error_body(exc.status, exc.message, exc.type, exc.param), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody is left to read it

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):  # path or query parameters
        on_bad_request()
        return JSONResponse(error_body(400, validation_message(exc.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code < 500:
            on_bad_request()
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)
