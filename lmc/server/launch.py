"""Running the app: `serve()` for `lmc serve` (blocks), `ServerThread` for tests and embedding (background)."""
from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time

log = logging.getLogger(__name__)


def _uvicorn_server(app, sock: socket.socket, log_level: str = "warning"):
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="asyncio", lifespan="off",
                            timeout_keep_alive=30, access_log=log_level in ("debug", "info"))
    return uvicorn.Server(config)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound. Its protocol is IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm
    off (TCP_NODELAY) only on connections whose socket says TCP, and with it on, a response written in two
    pieces (head, then body) waits for the client's delayed ACK of the first: 40 ms per request on a kept-alive
    connection. TCP_NODELAY is also set on the listener, which accepted connections inherit."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


class ServerThread:
    """Serve `app` on loopback from a background thread (a real TCP socket, chosen free port).

        with ServerThread(create_app(engine)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = listening_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = _uvicorn_server(app, self.sock, log_level)
        self._thread = threading.Thread(target=self._run, name="lmc-server", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def freeze_startup_heap() -> int:
    """Leave the objects alive at start-up (the model, the tokenizer, the app: ~480k objects with the embedded model)
    out of the garbage collector's scans, as vLLM's server does. They live as long as the process, yet each full
    collection walked them all: a 160-200 ms pause of every thread, the scheduler's included, on this project's
    2-core CPU; frozen, under 1 ms. Returns how many objects are frozen (server_info's `gc_frozen_objects`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          served_model_name: str | None = None, enable_metrics: bool = False, log_level: str = "info",
          max_pending: int = 4096, metrics_no_auth: bool = False, max_body_bytes: int | None = None,
          max_top_logprobs: int | None = None, grammar_cache_size: int | None = None,
          grammar_compile_timeout: float | None = None, **engine_kwargs) -> None:
    """Load the model, then serve until interrupted (what `lmc serve` runs). None leaves a limit at its default
    (app.create_app, protocol.Limits, grammar.GrammarCache)."""
    from ..runtime import Engine
    from .app import DEFAULT_MAX_BODY_BYTES, create_app
    from .protocol import Limits

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = listening_socket(host, port)  # a port in use fails now, not after the model has loaded
    log.info("loading %s", model)
    engine = Engine(model, **engine_kwargs)
    timeout = {} if grammar_compile_timeout is None else {"compile_timeout": grammar_compile_timeout}
    engine.grammars.configure(max_entries=grammar_cache_size, **timeout)
    server_args = {"model_path": model, "host": host, "port": port, "api_key_set": bool(api_key),
                   "enable_metrics": enable_metrics, **{k: v for k, v in engine_kwargs.items()
                                                         if isinstance(v, (str, int, float, bool, type(None)))}}
    limits = Limits() if max_top_logprobs is None else Limits(max_top_logprobs=max_top_logprobs)
    app = create_app(engine, api_key, served_model_name=served_model_name, enable_metrics=enable_metrics,
                     server_args=server_args, max_pending=max_pending, metrics_no_auth=metrics_no_auth,
                     max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES, limits=limits)
    freeze_startup_heap()
    server = _uvicorn_server(app, sock, log_level)
    print(f"lmc serve: {engine.model_name} on http://{host}:{port} (OpenAI routes under /v1; native /generate)",
          flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        engine.shutdown()
