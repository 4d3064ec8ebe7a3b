"""`lmc serve`: the engine behind HTTP. This module only assembles the app from its parts:

    app = create_app(engine, api_key="secret")      # an ASGI app; `lmc serve` runs it under uvicorn

- service.py: the Service every router shares (engine, tokenizer, metrics, limits, the worker pool);
- openai_api.py: /v1/completions, /v1/chat/completions, /v1/models;
- native_api.py: SGLang's /generate, /tokenize, /detokenize, model and server info, /flush_cache, health, /metrics;
- programs_api.py: POST /v1/programs (whole compiled programs run next to the engine);
- worker_api.py: what a gateway calls (/get_load);
- sse.py: streamed responses; errors.py: the error bodies; guard.py: the API key and the body limit (413).

Every bad request gets a 4xx JSON error naming the problem (OpenAI's shape: {"error": {"message", "type",
"param", "code"}}); nothing a client sends reaches the engine unvalidated (protocol.py parses bodies strictly and
holds the server's limits), and an error in one request never affects another. With an API key, every route but
/health needs it (/metrics too, unless `metrics_no_auth`).

The event loop never waits on tokenization, chat-template rendering, body parsing or grammar compilation: they run
in the service's worker pool (`Service.offload`), and requests are submitted to the engine from there. A client
that disconnects (mid-stream, or while waiting for a non-streamed response) has its requests aborted in the
engine: decoding stops and their KV slots are released, which `/get_server_info` shows (free + cached +
request-owned == total, as the engine's scheduler thread publishes it).
"""
from __future__ import annotations

from fastapi import FastAPI

from . import native_api, openai_api, programs_api
from .errors import install_error_handlers
from .guard import Guard
from .protocol import Limits
from .service import Service, version
from .worker_api import add_worker_routes

DEFAULT_MAX_BODY_BYTES = 4 << 20


def create_app(engine, api_key: str | None = None, *, served_model_name: str | None = None,
               enable_metrics: bool = True, server_args: dict | None = None, max_pending: int = 4096,
               metrics_no_auth: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               limits: Limits | None = None, worker_threads: int = 4,
               program_limits: programs_api.ProgramLimits | None = None):
    """An ASGI app serving `engine` (a lmc.runtime.Engine). `api_key`: required as `Authorization: Bearer KEY`
    (or `x-api-key`) on every route but /health, and /metrics when `metrics_no_auth` (for a scraper).
    `max_pending`: requests in flight beyond which the server answers 503. `max_body_bytes`: larger request
    bodies get a 413. `limits`: what one request may ask for (protocol.Limits); `program_limits`: what one
    /v1/programs call may (programs_api.ProgramLimits). `worker_threads`: the pool that tokenizes, parses and
    submits off the event loop."""
    svc = Service(engine, served_model_name or engine.model_name, dict(server_args or {}), max_pending,
                  limits or Limits(), worker_threads)
    app = FastAPI(title="lmc", version=version())
    app.state.service = svc
    install_error_handlers(app, svc.metrics.bad_request)
    open_paths = {"/health"} | ({"/metrics"} if metrics_no_auth else set())
    app.add_middleware(Guard, api_key=api_key, open_paths=open_paths, max_body_bytes=max_body_bytes,
                       on_refused=svc.metrics.bad_request)
    app.include_router(openai_api.router(svc))
    app.include_router(native_api.router(svc, enable_metrics))
    app.include_router(programs_api.router(svc, program_limits or programs_api.ProgramLimits()))
    add_worker_routes(app, svc)
    return app
