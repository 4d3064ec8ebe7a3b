"""`lmc serve`: HTTP over the runtime engine (OpenAI-compatible routes, SGLang-native routes, /metrics).

Needs the `server` extra (fastapi, uvicorn). Imported only by `lmc serve` and by code that builds an app.
"""
from .app import create_app
from .launch import ServerThread, serve
from .service import slot_accounting

__all__ = ["create_app", "serve", "ServerThread", "slot_accounting"]
