"""The service every router shares: the engine, its tokenizer and chat template, the metrics, the limits, and the
worker pool in which tokenization, template rendering, body parsing and request submission run (the event loop
never waits on them). Also what more than one router needs: running and streaming engine requests, sampling
validation, and the slot accounting the engine publishes.

A client that disconnects has its requests aborted in the engine (its coroutine is cancelled: `Service.run`
aborts, an `EngineStream` closed early aborts), so decoding stops and its KV slots are released.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from ..protocol.hints import HintsError, ProgramHints
from .errors import refused
from .metrics import Metrics
from .protocol import ApiError, Limits, check_limits, load_json, parse_body

log = logging.getLogger(__name__)


def slot_accounting(engine) -> dict[str, Any]:
    """KV slots by owner: free + cached (evictable + protected) + request-owned == total (`consistent`), as the
    engine's scheduler thread published them after its last step (Engine.load): never read across threads."""
    load = engine.load()
    snap = {k: load[k] for k in ("total_slots", "free_slots", "evictable_slots", "protected_slots", "cached_slots",
                                 "request_owned_slots", "resident_requests")}
    snap["consistent"] = snap["free_slots"] + snap["cached_slots"] + snap["request_owned_slots"] == \
        snap["total_slots"]
    return snap


class Service:
    """Request handling shared by the routes (holds the engine, tokenizer, metrics, limits and the worker pool in
    which tokenization, template rendering, body parsing and request submission run)."""

    def __init__(self, engine, served_model_name: str, server_args: dict, max_pending: int, limits: Limits,
                 worker_threads: int):
        from ..frontend.chat_template import ChatTemplate

        self.engine, self.tok = engine, engine.tokenizer
        self.model = served_model_name
        self.server_args = server_args
        self.metrics = Metrics(served_model_name)
        self.template = ChatTemplate.from_tokenizer(self.tok)
        self.max_pending = max_pending
        self.limits = limits
        self.vocab_size = engine.runner.cfg.vocab_size
        self.pool = ThreadPoolExecutor(worker_threads, thread_name_prefix="lmc-server")
        self.pending = 0
        self.started = time.time()
        self._tok_text: dict[int, str] = {}
        # A text of more characters than this cannot fit the context whatever its tokens (each token spells at
        # most `longest` characters; x2 for normalizers that fold characters): refused before tokenizing it.
        longest = max((len(t) for t in self.tok.get_vocab()), default=1) if self.tok is not None else 1
        self.max_prompt_chars = 2 * longest * engine.context_length

    # ---- helpers -------------------------------------------------------------------------------------------
    async def offload(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the worker pool (CPU work that must not stall the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    async def parse(self, request: Request, model):
        """The request body as `model` (parsed in the worker pool), or ApiError(400) naming the problem."""
        return await self.offload(parse_body, await request.body(), model)

    def encode(self, text: str, field: str = "prompt", **kw) -> list[int]:
        """Token ids of a prompt (call it in the worker pool); ApiError(400) naming `field` when it cannot be."""
        if self.tok is None:
            raise ApiError(400, f"model {self.model!r} has no tokenizer: send input_ids / token-id prompts", field)
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"{field} has {len(text)} characters, more than the model's context length of "
                                f"{self.engine.context_length} tokens can hold; shorten it", field)
        return self.tok.encode(text, **kw)

    def token_text(self, tid: int) -> str:
        s = self._tok_text.get(tid)
        if s is None:
            s = self.tok.decode([tid]) if self.tok is not None else ""
            if len(self._tok_text) < 200_000:
                self._tok_text[tid] = s
        return s

    def admit(self, k: int = 1) -> None:
        if k > self.max_pending:  # could never be admitted: the request's fault, not the server's load
            raise ApiError(400, f"the request makes {k} engine requests (prompts x n); this server takes at most "
                                f"{self.max_pending} at once", "n")
        if self.pending + k > self.max_pending:
            raise ApiError(503, f"the server is overloaded ({self.pending} requests in flight, limit "
                                f"{self.max_pending}); retry later", type_="overloaded_error")
        self.pending += k

    async def run(self, ids: list[int], params: dict, program=None) -> dict:
        """One request to completion; RequestError -> 400, an engine failure -> 500. Cancelled (the client is
        gone), it aborts the request so that decoding stops. `program`: its ProgramHints, if any."""
        from ..runtime.core import RequestError

        start = time.perf_counter()
        submitted = self.pool.submit(self.engine.submit, None, params, ids, program)  # validates, compiles
        try:
            fut = await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:  # gone while being submitted: abort it once it is in the engine
            submitted.add_done_callback(abort_once_submitted(self.engine))
            raise
        try:
            r = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if not fut.done():
                self.engine.abort(fut.rid)
            raise
        except RequestError as e:
            raise refused(e) from None
        except Exception as e:
            log.exception("request failed in the engine")
            raise ApiError(500, f"the engine failed the request: {type(e).__name__}: {e}") from None
        self.metrics.finished(r["meta_info"], start, structured(params))
        return r

    async def run_all(self, items: list[tuple[list[int], dict]], keep_failures: bool = False,
                      program=None) -> list:
        """Every item to completion, or the first error (the other requests are aborted). `keep_failures`: an
        item the engine failed (5xx) is returned as its exception and the others go on; a refused one (4xx: the
        request is bad) still fails them all. `program`: the hints every item carries."""
        self.admit(len(items))
        try:
            tasks = [asyncio.ensure_future(self._kept(self.run(ids, p, program)) if keep_failures
                                           else self.run(ids, p, program)) for ids, p in items]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            self.pending -= len(items)

    @staticmethod
    async def _kept(run):
        try:
            return await run
        except ApiError as e:
            if e.status < 500:
                raise
            return e

    async def stream(self, ids: list[int], params: dict, program=None) -> "EngineStream":
        """The engine's stream of one request. The first chunk is awaited before returning, so a refused request
        raises ApiError before any byte is sent. The caller has admitted it and must close it."""
        from ..runtime.core import RequestError

        start = time.perf_counter()
        gen = self.engine.async_stream(None, params, ids, executor=self.pool, program=program)
        try:
            first = await gen.__anext__()
        except RequestError as e:
            raise refused(e) from None
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the stream without a result") from None
        return EngineStream(self, gen, first, start, structured(params))

    def check_meta(self, meta: dict) -> None:
        fr = meta.get("finish_reason") or {}
        if fr.get("type") == "abort":
            raise ApiError(500, f"the request was aborted: {fr.get('message')}", type_="server_error")


def abort_once_submitted(engine):
    def callback(submitted) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            engine.abort(submitted.result().rid)  # a refused request has rid None: ignored
    return callback


class EngineStream:
    """The chunks of one streamed request ({"text": delta}; the last one also carries the result), counted in the
    service's `pending` until closed. Closing it before its end aborts the request in the engine."""

    def __init__(self, svc: Service, gen, first: dict, start: float, structured: bool):
        self.svc, self.gen, self.first, self.start, self.structured = svc, gen, first, start, structured
        self.t_first = time.perf_counter()
        self.closed = False

    def __aiter__(self) -> "EngineStream":
        return self

    async def __anext__(self) -> dict:
        if self.first is not None:
            chunk, self.first = self.first, None
        else:
            chunk = await self.gen.__anext__()
        if "meta_info" in chunk:
            self.svc.metrics.finished(chunk["meta_info"], self.start, self.structured, self.t_first)
        return chunk

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.svc.pending -= 1
            await self.gen.aclose()  # runs the engine stream's `finally`: aborts the request if it is not done


def structured(params: dict) -> bool:
    return any(params.get(k) is not None for k in ("regex", "json_schema", "ebnf"))

# ---- what several routers check ----------------------------------------------------------------------------------
def load_object(raw: bytes) -> dict:
    """A request body that must be a JSON object (call it in the worker pool); ApiError(400) otherwise."""
    body = load_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def json_object(request: Request, svc: Service) -> dict:
    return await svc.offload(load_object, await request.body())


def check_token_ids(svc: Service, ids: list[int], field: str) -> None:
    bad = next((t for t in ids if isinstance(t, bool) or not 0 <= t < svc.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"{field}: token id {bad} is outside the model's vocabulary [0, {svc.vocab_size})",
                       field)


def program_hints(value, field: str = "program") -> ProgramHints | None:
    """A request's `program` field (its program hints) as ProgramHints; ApiError(400) naming the bad entry."""
    if value is None:
        return None
    try:
        return ProgramHints.from_dict(value, field)
    except HintsError as e:
        raise ApiError(400, str(e), field) from None


def validate_params(svc: Service, p: dict) -> None:
    """Fail fast (400) on a bad sampling value or one beyond the server's limits, before any request is queued."""
    from ..runtime.core import RequestError, SamplingParams

    for name in ("stop", "stop_token_ids", "token_ids_logprob"):  # a scalar where a list belongs
        if p.get(name) is not None and not isinstance(p[name], list) and not (name == "stop" and
                                                                            isinstance(p[name], str)):
            raise ApiError(400, f"invalid sampling parameter {name}={p[name]!r}: must be a list", name)
    try:
        SamplingParams.from_dict(dict(p))
    except RequestError as e:
        named = re.match(r"invalid sampling parameter (\w+)", str(e))
        raise ApiError(400, str(e), named and named.group(1)) from None
    except TypeError as e:
        raise ApiError(400, f"invalid sampling parameters: {e}") from None
    check_limits(p, svc.vocab_size, svc.limits)


def n_params(svc: Service, p: dict, n: int) -> list[dict]:
    if not isinstance(n, int) or n < 1:
        raise ApiError(400, f"n must be an integer >= 1, got {n!r}", "n")
    if n > svc.limits.max_n:
        raise ApiError(400, f"n must be <= {svc.limits.max_n}, got {n}", "n")
    seed = p.get("seed")
    return [{**p, "seed": None if seed is None else seed + i} for i in range(n)]


def jsonable(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}


def version() -> str:
    try:
        from .. import __version__

        return __version__
    except Exception:  # pragma: no cover
        return "0"
