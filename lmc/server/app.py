"""`lmc serve`: the engine behind HTTP. OpenAI-compatible routes, SGLang-native routes, Prometheus metrics.

    app = create_app(engine, api_key="secret")      # an ASGI app; `lmc serve` runs it under uvicorn

Routes (DESIGN 6):
    POST /v1/completions, /v1/chat/completions      OpenAI (SSE streaming, usage with cached tokens, logprobs,
                                                    response_format, n, stop, seed, logit_bias; extras regex / ebnf /
                                                    json_schema / structured_outputs / top_k / min_p ...)
    GET  /v1/models
    POST /generate                                  SGLang-native: text or input_ids, single or batch,
                                                    max_new_tokens 0, logprobs with logprob_start_len, streaming
    GET  /get_model_info (/model_info), /get_server_info (/server_info)
    POST /flush_cache                               (state-changing routes are POST only: a GET is a 405)
    GET  /health, /health_generate, /metrics

Every bad request gets a 4xx JSON error naming the problem (OpenAI's shape: {"error": {"message", "type",
"param", "code"}}); nothing a client sends reaches the engine unvalidated (protocol.py parses bodies strictly and
holds the server's limits), and an error in one request never affects another. With an API key, every route but
/health needs it (/metrics too, unless `metrics_no_auth`); see guard.py, which also bounds the body (413).

The event loop never waits on tokenization, chat-template rendering, body parsing or grammar compilation: they run
in the service's worker pool (`_Service.offload`), and requests are submitted to the engine from there.

A client that disconnects (mid-stream, or while waiting for a non-streamed response) has its requests aborted in
the engine: decoding stops and their KV slots are released, which `/get_server_info` shows (free + cached +
request-owned == total).

Streaming `/generate` follows SGLang: one prompt streams events whose `text` is the output so far; a batch (a list
of prompts, or n > 1) interleaves the events of all its requests, each marked with its position in the batch
(`index`, prompt-major: prompt k's j-th sample is k * n + j).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .guard import Guard
from .metrics import Metrics
from .protocol import (ApiError, ChatCompletionRequest, CompletionRequest, GenerateRequest, Limits, check_limits,
                       error_body, load_json, parse_body, validation_message)
from .worker_api import add_worker_routes

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
SGLANG_SAMPLING_DEFAULTS = {  # SGLang keys lmc accepts only at their default value (they change nothing here)
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "stop_regex": [], "custom_params": None, "structural_tag": None, "stream_interval": None,
}
_NO_VALUE = object()


class ClientGone(Exception):
    """The client closed the connection before its response was ready (its engine requests were aborted)."""


def slot_accounting(engine) -> dict[str, Any]:
    """KV slots by owner: free + cached (evictable + protected) + request-owned == total. Read from the scheduler
    thread's structures without stopping it, so a read taken mid-step can be torn; it is retried until it adds up
    (when idle it is exact)."""
    sched = engine.scheduler
    snap = {"total_slots": engine.max_total_tokens, "free_slots": 0, "evictable_slots": 0, "protected_slots": 0,
            "cached_slots": 0, "request_owned_slots": 0, "resident_requests": 0, "consistent": None}
    for _ in range(20):
        try:
            resident = list(sched.resident())
            owned = sum(max(0, r.kv_len - r.cache_protected_len) for r in resident if r.row >= 0)
            cache = sched.cache
            snap = {"total_slots": engine.max_total_tokens, "free_slots": sched.allocator.available,
                    "evictable_slots": cache.evictable_size, "protected_slots": cache.protected_size,
                    "cached_slots": cache.evictable_size + cache.protected_size, "request_owned_slots": owned,
                    "resident_requests": len(resident)}
        except Exception:  # a list changed size under us
            continue
        snap["consistent"] = snap["free_slots"] + snap["cached_slots"] + snap["request_owned_slots"] == \
            snap["total_slots"]
        if snap["consistent"]:
            break
        time.sleep(0.001)
    return snap


class _Service:
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

    async def run(self, ids: list[int], params: dict) -> dict:
        """One request to completion; RequestError -> 400, an engine failure -> 500. Cancelled (the client is
        gone), it aborts the request so that decoding stops."""
        from ..runtime.core import RequestError

        start = time.perf_counter()
        submitted = self.pool.submit(self.engine.submit, None, params, ids)  # validates, compiles a grammar
        try:
            fut = await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:  # gone while being submitted: abort it once it is in the engine
            submitted.add_done_callback(_abort_once_submitted(self.engine))
            raise
        try:
            r = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if not fut.done():
                self.engine.abort(fut.rid)
            raise
        except RequestError as e:
            raise _refused(e) from None
        except Exception as e:
            log.exception("request failed in the engine")
            raise ApiError(500, f"the engine failed the request: {type(e).__name__}: {e}") from None
        self.metrics.finished(r["meta_info"], start, _structured(params))
        return r

    async def run_all(self, items: list[tuple[list[int], dict]], keep_failures: bool = False) -> list:
        """Every item to completion, or the first error (the other requests are aborted). `keep_failures`: an
        item the engine failed (5xx) is returned as its exception and the others go on; a refused one (4xx: the
        request is bad) still fails them all."""
        self.admit(len(items))
        try:
            tasks = [asyncio.ensure_future(self._kept(self.run(ids, p)) if keep_failures else self.run(ids, p))
                     for ids, p in items]
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

    async def stream(self, ids: list[int], params: dict) -> "_EngineStream":
        """The engine's stream of one request. The first chunk is awaited before returning, so a refused request
        raises ApiError before any byte is sent. The caller has admitted it and must close it."""
        from ..runtime.core import RequestError

        start = time.perf_counter()
        gen = self.engine.async_stream(None, params, ids, executor=self.pool)
        try:
            first = await gen.__anext__()
        except RequestError as e:
            raise _refused(e) from None
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the stream without a result") from None
        return _EngineStream(self, gen, first, start, _structured(params))

    def check_meta(self, meta: dict) -> None:
        fr = meta.get("finish_reason") or {}
        if fr.get("type") == "abort":
            raise ApiError(500, f"the request was aborted: {fr.get('message')}", type_="server_error")


def _refused(e: Exception) -> ApiError:
    """The engine's RequestError as the HTTP error: 400, or 503 when it is about load (GrammarBusy)."""
    from ..runtime.grammar import GrammarBusy

    if isinstance(e, GrammarBusy):
        return ApiError(503, str(e), type_="overloaded_error")
    return ApiError(400, str(e))


def _abort_once_submitted(engine):
    def callback(submitted) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            engine.abort(submitted.result().rid)  # a refused request has rid None: ignored
    return callback


class _EngineStream:
    """The chunks of one streamed request ({"text": delta}; the last one also carries the result), counted in the
    service's `pending` until closed. Closing it before its end aborts the request in the engine."""

    def __init__(self, svc: _Service, gen, first: dict, start: float, structured: bool):
        self.svc, self.gen, self.first, self.start, self.structured = svc, gen, first, start, structured
        self.t_first = time.perf_counter()
        self.closed = False

    def __aiter__(self) -> "_EngineStream":
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


def _structured(params: dict) -> bool:
    return any(params.get(k) is not None for k in ("regex", "json_schema", "ebnf"))


# ---- OpenAI sampling translation -------------------------------------------------------------------------------
def _constraint(req, response_format) -> dict:
    """Engine constraint fields from the request's extras / response_format / structured_outputs."""
    out: dict[str, Any] = {}
    if req.regex is not None:
        out["regex"] = req.regex
    if req.ebnf is not None:
        out["ebnf"] = req.ebnf
    if req.json_schema is not None:
        out["json_schema"] = req.json_schema
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
            out.setdefault("json_schema", response_format.json_schema.schema_)
        else:
            out.setdefault("json_schema", {"type": "object"})
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("choice", "regex", "json_", "grammar") if getattr(so, k) is not None]
        if len(given) != 1:
            raise ApiError(400, "structured_outputs takes exactly one of choice, regex, json, grammar",
                           "structured_outputs")
        k = given[0]
        if k == "choice":
            if not so.choice:
                raise ApiError(400, "structured_outputs.choice must be a non-empty list", "structured_outputs")
            out["regex"] = "(" + "|".join(re.escape(c) for c in so.choice) + ")"
        else:
            out[{"regex": "regex", "json_": "json_schema", "grammar": "ebnf"}[k]] = getattr(so, k)
    if len(out) > 1:
        raise ApiError(400, f"at most one constraint may be given: got {', '.join(sorted(out))}")
    return out


def _openai_params(svc: _Service, req, prompt_len: int, max_tokens: int | None, default_max: int | None) -> dict:
    ctx = svc.engine.context_length
    if prompt_len >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens; the prompt has {prompt_len} "
                            "tokens. Shorten the prompt.", "messages" if hasattr(req, "messages") else "prompt")
    if max_tokens is None:
        max_tokens = ctx - prompt_len if default_max is None else min(default_max, ctx - prompt_len)
    elif not isinstance(max_tokens, int) or max_tokens < 0:
        raise ApiError(400, f"max_tokens must be a non-negative integer, got {max_tokens!r}", "max_tokens")
    elif prompt_len + max_tokens > ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                            "completion). Reduce the prompt or max_tokens.", "max_tokens")
    if not req.skip_special_tokens:
        raise ApiError(400, "skip_special_tokens=false is not supported by this server", "skip_special_tokens")
    p: dict[str, Any] = {"max_new_tokens": max_tokens}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                     ("repetition_penalty", "repetition_penalty"), ("seed", "seed"), ("stop", "stop"),
                     ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
                     ("min_tokens", "min_new_tokens"), ("logit_bias", "logit_bias")):
        v = getattr(req, src)
        if v is not None:
            p[dst] = v
    if isinstance(p.get("stop"), list) and not p["stop"]:
        del p["stop"]
    return p


def _validate_params(svc: _Service, p: dict) -> None:
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


def _n_params(svc: _Service, p: dict, n: int) -> list[dict]:
    if not isinstance(n, int) or n < 1:
        raise ApiError(400, f"n must be an integer >= 1, got {n!r}", "n")
    if n > svc.limits.max_n:
        raise ApiError(400, f"n must be <= {svc.limits.max_n}, got {n}", "n")
    seed = p.get("seed")
    return [{**p, "seed": None if seed is None else seed + i} for i in range(n)]


def _finish(meta: dict) -> str:
    t = (meta.get("finish_reason") or {}).get("type")
    return "length" if t == "length" else "stop"


def _usage(results: list[dict], prompts: list[int]) -> dict:
    """Prompt tokens counted once per prompt (as OpenAI bills n>1), completion tokens summed."""
    metas = [r["meta_info"] for r in results]
    prompt = sum(prompts)
    completion = sum(m["completion_tokens"] for m in metas)
    per_prompt: dict[int, int] = {}
    for r in results:
        per_prompt.setdefault(r["_prompt_index"], r["meta_info"].get("cached_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())}}


def _with_sglext(req, response: dict) -> dict:
    """SGLang's response extension: with return_cached_tokens_details, where the cached prompt tokens came from
    (lmc's prefix cache is all in device memory: no host tier)."""
    if req.return_cached_tokens_details:
        cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
        response["sglext"] = {"cached_tokens_details": {"device": cached, "host": 0}}
    return response


def _chat_logprobs(svc: _Service, meta: dict, top: int) -> dict:
    content = []
    tops = meta.get("output_top_logprobs") or []
    for i, (lp, tid, _) in enumerate(meta.get("output_token_logprobs") or []):
        tok = svc.token_text(tid)
        entry = {"token": tok, "logprob": 0.0 if lp is None else lp, "bytes": list(tok.encode()),
                 "top_logprobs": []}
        if top and i < len(tops) and tops[i]:
            entry["top_logprobs"] = [{"token": svc.token_text(t), "logprob": v,
                                      "bytes": list(svc.token_text(t).encode())} for v, t, _ in tops[i][:top]]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(svc: _Service, meta: dict, top: int, echo: bool, offset0: int) -> dict:
    entries = list(meta.get("output_token_logprobs") or [])
    tops = list(meta.get("output_top_logprobs") or [])
    if echo:
        entries = list(meta.get("input_token_logprobs") or []) + entries
        tops = list(meta.get("input_top_logprobs") or [None] * len(meta.get("input_token_logprobs") or [])) + tops
    tokens, lps, top_out, offsets = [], [], [], []
    pos = offset0
    for i, (lp, tid, _) in enumerate(entries):
        t = svc.token_text(tid)
        tokens.append(t)
        lps.append(lp)
        offsets.append(pos)
        pos += len(t)
        row = tops[i] if i < len(tops) else None
        top_out.append({svc.token_text(x): v for v, x, _ in (row or [])[:top]} if top else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave several chunk streams as (index, chunk). Closing or cancelling the consumer cancels every
    producer and waits for them, so the streams can be closed right after."""
    if len(streams) == 1:
        async for c in streams[0]:
            yield 0, c
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for c in s:
                await q.put((i, c))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, c = await q.get()
            if c is done:
                left -= 1
            elif isinstance(c, BaseException):
                raise c
            else:
                yield i, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the app ---------------------------------------------------------------------------------------------------
def create_app(engine, api_key: str | None = None, *, served_model_name: str | None = None,
               enable_metrics: bool = True, server_args: dict | None = None, max_pending: int = 4096,
               metrics_no_auth: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               limits: Limits | None = None, worker_threads: int = 4):
    """An ASGI app serving `engine` (a lmc.runtime.Engine). `api_key`: required as `Authorization: Bearer KEY`
    (or `x-api-key`) on every route but /health, and /metrics when `metrics_no_auth` (for a scraper).
    `max_pending`: requests in flight beyond which the server answers 503. `max_body_bytes`: larger request
    bodies get a 413. `limits`: what one request may ask for (protocol.Limits). `worker_threads`: the pool that
    tokenizes, parses and submits off the event loop."""
    svc = _Service(engine, served_model_name or engine.model_name, dict(server_args or {}), max_pending,
                   limits or Limits(), worker_threads)
    app = FastAPI(title="lmc", version=_version())
    app.state.service = svc

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status < 500:
            svc.metrics.bad_request()
        return JSONResponse(error_body(exc.status, exc.message, exc.type, exc.param), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody is left to read it

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):  # path or query parameters
        svc.metrics.bad_request()
        return JSONResponse(error_body(400, validation_message(exc.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code < 500:
            svc.metrics.bad_request()
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    open_paths = {"/health"} | ({"/metrics"} if metrics_no_auth else set())
    app.add_middleware(Guard, api_key=api_key, open_paths=open_paths, max_body_bytes=max_body_bytes,
                       on_refused=svc.metrics.bad_request)

    # ---- OpenAI: completions -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await svc.parse(request, CompletionRequest)
        texts, id_lists, items, prompt_index = await svc.offload(_completion_items, svc, req)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice_logprobs(meta, k):
            if req.logprobs is None:
                return None
            return _completion_logprobs(svc, meta, req.logprobs, req.echo, 0)

        if req.stream:
            async def events(merged):
                results: dict[int, dict] = {}
                texts_out = {i: "" for i in range(len(items))}
                async for i, c in merged:
                    k = prompt_index[i]
                    delta = (texts[k] if req.echo and not texts_out[i] and c["text"] is not None else "") + c["text"]
                    texts_out[i] += c["text"]
                    fin = "meta_info" in c
                    if fin:
                        svc.check_meta(c["meta_info"])
                        results[i] = {**c, "_prompt_index": k}
                    if delta or fin:
                        yield _sse({"id": cid, "object": "text_completion", "created": created,
                                    "model": svc.model, "choices": [{
                                        "index": i, "text": delta,
                                        "logprobs": choice_logprobs(c["meta_info"], k) if fin else None,
                                        "finish_reason": _finish(c["meta_info"]) if fin else None}]})
                if req.stream_options is not None and req.stream_options.include_usage:
                    ordered = [results[i] for i in sorted(results)]
                    yield _sse({"id": cid, "object": "text_completion", "created": created,
                                "model": svc.model, "choices": [],
                                "usage": _usage(ordered, [len(x) for x in id_lists])})

            return _EventStream(await _start_streams(svc, items), events)

        results = await _unless_disconnected(request, svc.run_all(items))
        choices = []
        for i, (r, k) in enumerate(zip(results, prompt_index)):
            svc.check_meta(r["meta_info"])
            r["_prompt_index"] = k
            choices.append({"index": i, "text": (texts[k] if req.echo else "") + r["text"],
                            "logprobs": choice_logprobs(r["meta_info"], k), "finish_reason": _finish(r["meta_info"]),
                            "matched_stop": (r["meta_info"].get("finish_reason") or {}).get("matched")})
        return _with_sglext(req, {"id": cid, "object": "text_completion", "created": created, "model": svc.model,
                                  "choices": choices, "usage": _usage(results, [len(x) for x in id_lists])})

    # ---- OpenAI: chat completions ------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await svc.parse(request, ChatCompletionRequest)
        _check_model(svc, req.model)
        if req.tools:
            raise ApiError(400, "tools are not supported by this server", "tools")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ApiError(400, "top_logprobs must be in [0, 20]", "top_logprobs")
        ids = await svc.offload(lambda: svc.encode(_render_chat(svc, req), "messages"))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        constraint = _constraint(req, req.response_format)
        p = {**_openai_params(svc, req, len(ids), max_tokens, None), **constraint}
        if svc.template.stop_token_ids:
            p["stop_token_ids"] = list(p.get("stop_token_ids") or []) + list(svc.template.stop_token_ids)
        top = req.top_logprobs or 0
        if req.logprobs:
            p.update(return_logprob=True, top_logprobs_num=top)
        _validate_params(svc, p)
        items = [(ids, q) for q in _n_params(svc, p, req.n)]
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if req.stream:
            def chunk(choices, usage=_NO_VALUE):
                out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": svc.model,
                       "choices": choices}
                if usage is not _NO_VALUE:
                    out["usage"] = usage
                return _sse(out)

            async def events(merged):
                results: dict[int, dict] = {}
                for i in range(len(items)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                async for i, c in merged:
                    fin = "meta_info" in c
                    if c["text"]:
                        yield chunk([{"index": i, "delta": {"content": c["text"]}, "logprobs": None,
                                      "finish_reason": None}])
                    if fin:
                        svc.check_meta(c["meta_info"])
                        results[i] = {**c, "_prompt_index": 0}
                        yield chunk([{"index": i, "delta": {},
                                      "logprobs": _chat_logprobs(svc, c["meta_info"], top) if req.logprobs
                                      else None, "finish_reason": _finish(c["meta_info"])}])
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield chunk([], _usage([results[i] for i in sorted(results)], [len(ids)]))

            return _EventStream(await _start_streams(svc, items), events)

        results = await _unless_disconnected(request, svc.run_all(items))
        choices = []
        for i, r in enumerate(results):
            svc.check_meta(r["meta_info"])
            r["_prompt_index"] = 0
            choices.append({"index": i, "message": {"role": "assistant", "content": r["text"]},
                            "logprobs": _chat_logprobs(svc, r["meta_info"], top) if req.logprobs else None,
                            "finish_reason": _finish(r["meta_info"]),
                            "matched_stop": (r["meta_info"].get("finish_reason") or {}).get("matched")})
        return _with_sglext(req, {"id": cid, "object": "chat.completion", "created": created, "model": svc.model,
                                  "choices": choices, "usage": _usage(results, [len(ids)])})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model, "object": "model", "created": int(svc.started),
                                            "owned_by": "lmc", "root": svc.engine.model_name,
                                            "max_model_len": svc.engine.context_length}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != svc.model:
            raise ApiError(404, f"model {model_id!r} not found; this server serves {svc.model!r}", "model")
        return {"id": svc.model, "object": "model", "created": int(svc.started), "owned_by": "lmc"}

    # ---- SGLang-native -----------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        return await _native_generate(svc, await svc.parse(request, GenerateRequest), request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json_object(request, svc)
        unknown = set(body) - {"prompt", "text", "add_special_tokens", "model"}
        if unknown:
            raise ApiError(400, f"unknown field(s) {sorted(unknown)}")
        prompt = body.get("prompt", body.get("text"))
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ApiError(400, "add_special_tokens must be a boolean", "add_special_tokens")
        if isinstance(prompt, str):
            ids = await svc.offload(svc.encode, prompt, add_special_tokens=special)
            return {"tokens": ids, "count": len(ids), "max_model_len": svc.engine.context_length}
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            ids = await svc.offload(lambda: [svc.encode(p, add_special_tokens=special) for p in prompt])
            return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": svc.engine.context_length}
        raise ApiError(400, "prompt must be a string or a list of strings", "prompt")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json_object(request, svc)
        tokens = body.get("tokens")
        if svc.tok is None or not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "tokens must be a list of token ids", "tokens")
        _check_token_ids(svc, tokens, "tokens")
        return {"text": await svc.offload(svc.tok.decode, tokens)}

    @app.api_route("/get_model_info", methods=["GET"])
    @app.api_route("/model_info", methods=["GET"])
    async def model_info():
        eng, t = svc.engine, svc.template
        cfg = getattr(eng.runner, "cfg", None)
        return {"model_path": eng.model_name, "served_model_name": svc.model, "tokenizer_path": eng.model_name,
                "is_generation": True, "has_image_understanding": False, "has_audio_understanding": False,
                "preferred_sampling_params": None, "weight_version": "default",
                "context_length": eng.context_length, "max_total_num_tokens": eng.max_total_tokens,
                "vocab_size": getattr(cfg, "vocab_size", None),
                "eos_token_ids": list(getattr(cfg, "eos_token_ids", ()) or ()),
                "chat_template": getattr(svc.tok, "chat_template", None) if svc.tok is not None else None,
                "chat_template_roles": {"prefix": t.prefix, "suffix": t.suffix, "default_system": t.default_system,
                                        "stop_token_ids": list(t.stop_token_ids)},
                "engine": "lmc", "version": _version()}

    @app.api_route("/get_server_info", methods=["GET"])
    @app.api_route("/server_info", methods=["GET"])
    async def server_info():
        stats, slots = svc.engine.stats(), slot_accounting(svc.engine)
        return {**svc.server_args, "served_model_name": svc.model, "version": _version(), "engine": "lmc",
                "context_length": svc.engine.context_length, "max_total_num_tokens": svc.engine.max_total_tokens,
                "in_flight_requests": svc.pending, "internal_states": [{**_jsonable(stats), "slots": slots}],
                "slots": slots}

    @app.post("/flush_cache")  # POST only (SGLang's clients POST): a page cannot trigger it with a plain GET
    async def flush_cache():
        ok = await asyncio.to_thread(svc.engine.flush_cache)
        if not ok:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be "
                                 "performed.)\n")

    @app.get("/health")
    async def health():
        if not svc.engine._thread.is_alive():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if not svc.engine._thread.is_alive():
            return Response(status_code=503)
        ids = svc.encode("ping") if svc.tok is not None else [1]
        try:
            await asyncio.wait_for(asyncio.wrap_future(svc.engine.submit(
                None, {"max_new_tokens": 1, "temperature": 0}, ids)), timeout=60)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        if not enable_metrics:
            raise ApiError(404, "metrics are disabled: start the server with --enable-metrics")
        text = svc.metrics.render(svc.engine.stats(), slot_accounting(svc.engine), svc.engine.grammars.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    add_worker_routes(app, svc)  # what a gateway calls beyond the serving API (worker_api.py)
    return app


# ---- route bodies ----------------------------------------------------------------------------------------------
async def _json_object(request: Request, svc: _Service) -> dict:
    body = await svc.offload(load_json, await request.body())
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_token_ids(svc: _Service, ids: list[int], field: str) -> None:
    bad = next((t for t in ids if isinstance(t, bool) or not 0 <= t < svc.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"{field}: token id {bad} is outside the model's vocabulary [0, {svc.vocab_size})",
                       field)


def _completion_items(svc: _Service, req: CompletionRequest):
    """(prompt texts, prompt ids, engine items, prompt index of each item) of a /v1/completions request (in the
    worker pool: it tokenizes)."""
    _check_model(svc, req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if req.best_of not in (None, 1, req.n):
        raise ApiError(400, "best_of is not supported (use n)", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise ApiError(400, "logprobs must be in [0, 20]", "logprobs")
    prompts = req.prompt
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ApiError(400, "prompt must not be empty", "prompt")
    texts, id_lists = [], []
    for p in prompts:
        if isinstance(p, str):
            texts.append(p)
            id_lists.append(svc.encode(p))
        else:
            _check_token_ids(svc, p, "prompt")
            texts.append(svc.tok.decode(p) if svc.tok is not None else "")
            id_lists.append(list(p))
    constraint = _constraint(req, req.response_format)
    items, prompt_index = [], []
    for k, ids in enumerate(id_lists):
        p = {**_openai_params(svc, req, len(ids), req.max_tokens, 16), **constraint}
        if req.logprobs is not None:
            p.update(return_logprob=True, top_logprobs_num=req.logprobs)
            if req.echo:
                p["logprob_start_len"] = 0
        _validate_params(svc, p)
        for q in _n_params(svc, p, req.n):
            items.append((ids, q))
            prompt_index.append(k)
    return texts, id_lists, items, prompt_index


def _check_model(svc: _Service, model: str | None) -> None:
    # Any name is accepted (clients often send a placeholder); it is echoed back as the served name.
    return None


def _render_chat(svc: _Service, req: ChatCompletionRequest) -> str:
    msgs = []
    for k, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if getattr(part, "type", None) != "text":
                    raise ApiError(400, f"messages[{k}]: {part.type} content is not supported: the model "
                                        f"{svc.model!r} is text-only", "messages")
                parts.append(part.text)
            content = "".join(parts)
        if m.role in ("tool", "function"):
            raise ApiError(400, f"messages[{k}]: role {m.role!r} is not supported (no tool calling)", "messages")
        msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    if not msgs:
        raise ApiError(400, "messages must not be empty", "messages")
    cont = req.continue_final_message
    if cont and msgs[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs a final assistant message", "messages")
    head, tail = (msgs[:-1], msgs[-1]["content"]) if cont else (msgs, "")
    gen_prompt = cont or req.add_generation_prompt
    tok = svc.tok
    if tok is not None and getattr(tok, "chat_template", None):
        if not head:
            text = svc.template.default_system + svc.template.prefix["assistant"] if gen_prompt else ""
        else:
            try:
                text = tok.apply_chat_template(head, tokenize=False, add_generation_prompt=gen_prompt)
            except Exception as e:
                raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
    else:
        t = svc.template
        text = "" if head and head[0]["role"] == "system" else t.default_system
        text += "".join(t.prefix[m["role"]] + m["content"] + t.suffix[m["role"]] for m in head)
        if gen_prompt:
            text += t.prefix["assistant"]
    return text + tail


async def _start_streams(svc: _Service, items) -> list[_EngineStream]:
    """One engine stream per item, all submitted at once. Returns when each has its first chunk, so a refused
    request raises ApiError before any byte is sent (the others are then closed, which aborts them)."""
    svc.admit(len(items))
    try:
        started = await asyncio.gather(*(svc.stream(ids, p) for ids, p in items), return_exceptions=True)
    except BaseException:  # this handler was cancelled, and the engine streams with it (which aborted them)
        svc.pending -= len(items)
        raise
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        svc.pending -= len(failed)
        await _close([s for s in started if not isinstance(s, BaseException)])
        raise failed[0]
    return started


async def _close(streams) -> None:
    for s in streams:
        try:
            await s.aclose()
        except Exception:  # noqa: BLE001 - closing is best effort; the engine stream aborts itself when collected
            pass


class _EventStream(StreamingResponse):
    """The SSE response over engine streams: `events(merged)` turns their interleaved (index, chunk) pairs into
    events; an error becomes an error event, and `data: [DONE]` ends the body. However the response ends (done,
    failed, or the client hung up), the streams are closed at once, which aborts what is still running. (Starlette
    leaves the body suspended when the client disconnects: it would be closed only when garbage-collected.)"""

    def __init__(self, streams: list[_EngineStream], events):
        self.streams = streams
        super().__init__(self._body(events), media_type="text/event-stream")

    async def _body(self, events):
        merged = _merge(self.streams)
        out = events(merged)
        try:
            async for event in out:
                yield event
        except ApiError as e:
            yield _sse(error_body(e.status, e.message, e.type))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            log.exception("a streamed request failed")
            yield _sse(error_body(500, f"{type(e).__name__}: {e}", "server_error"))
        finally:
            await out.aclose()
            await merged.aclose()
        yield b"data: [DONE]\n\n"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await _close(self.streams)


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up. The request body has been read, so the next ASGI message it can get is the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work):
    """Await `work` (engine requests), unless the client hangs up first: then `work` is cancelled, which aborts its
    requests so that decoding stops, and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait([task, hangup], return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not task.done():  # the client is gone, or this handler was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        raise ClientGone()
    return task.result()


def _native_items(svc: _Service, req: GenerateRequest) -> tuple[list[tuple[list[int], dict]], bool, list[int]]:
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", "text")
    if req.text is not None:
        single = isinstance(req.text, str)
        prompts = [req.text] if single else list(req.text)
        ids = [svc.encode(t, "text") for t in prompts]
    else:
        single = not (req.input_ids and isinstance(req.input_ids[0], list))
        ids = [list(req.input_ids)] if single else [list(x) for x in req.input_ids]
    if not ids:
        raise ApiError(400, "empty batch", "text")
    b = len(ids)

    def per_item(v, name):
        if isinstance(v, list):
            if len(v) != b:
                raise ApiError(400, f"{name}: {len(v)} values for {b} prompts", name)
            return v
        return [v] * b

    sps = per_item(req.sampling_params or {}, "sampling_params")
    rl = per_item(req.return_logprob, "return_logprob")
    ls = per_item(req.logprob_start_len, "logprob_start_len")
    tn = per_item(req.top_logprobs_num, "top_logprobs_num")
    ti = req.token_ids_logprob  # one id list for every prompt, or one per prompt
    ti = per_item(ti, "token_ids_logprob") if ti and isinstance(ti[0], list) else [ti] * b
    items, index = [], []
    for k in range(b):
        sp = dict(sps[k] or {})
        if not isinstance(sp, dict):
            raise ApiError(400, "sampling_params must be an object", "sampling_params")
        p: dict[str, Any] = {}
        n = sp.pop("n", 1) or 1
        if "sampling_seed" in sp:
            sp.setdefault("seed", sp.pop("sampling_seed"))
        for key, default in SGLANG_SAMPLING_DEFAULTS.items():
            if key in sp:
                v = sp.pop(key)
                if v not in (default, None) and not (isinstance(default, (list, dict)) and not v):
                    raise ApiError(400, f"sampling_params.{key}={v!r} is not supported by this server",
                                   "sampling_params")
        for key, v in sp.items():
            if v is not None:
                p[key] = v
        if rl[k]:
            p["return_logprob"] = True
        if ls[k] is not None:
            p["logprob_start_len"] = ls[k]
        if tn[k] is not None:
            p["top_logprobs_num"] = tn[k]
        if ti[k] is not None:
            p["token_ids_logprob"] = ti[k]
        if not isinstance(n, int) or n < 1:
            raise ApiError(400, f"sampling_params.n must be a positive integer, got {n!r}", "sampling_params")
        if isinstance(p.get("logprob_start_len"), int) and p["logprob_start_len"] > len(ids[k]):
            raise ApiError(400, f"logprob_start_len ({p['logprob_start_len']}) exceeds the prompt length "
                                f"({len(ids[k])})", "logprob_start_len")
        _validate_params(svc, p)
        for q in (_n_params(svc, p, n) if n > 1 else [p]):
            items.append((ids[k], q))
            index.append(k)
    return items, single and len(items) == 1, index


def _native_result(svc: _Service, r: dict, text_in_logprobs: bool, start: float) -> dict:
    meta = r["meta_info"]
    meta["e2e_latency"] = time.perf_counter() - start
    if text_in_logprobs:
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta:
                meta[key] = [(lp, t, svc.token_text(t)) for lp, t, _ in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = [None if row is None else [(lp, t, svc.token_text(t)) for lp, t, _ in row]
                             for row in meta[key]]
    return {"text": r["text"], "output_ids": r["output_ids"], "meta_info": meta}


async def _native_generate(svc: _Service, req: GenerateRequest, request: Request):
    start = time.perf_counter()
    items, single, _ = await svc.offload(_native_items, svc, req)
    if req.stream:
        async def events(merged):
            texts = [""] * len(items)
            async for i, c in merged:
                texts[i] += c["text"]
                if "meta_info" in c:
                    out = _native_result(svc, {**c, "text": texts[i]}, req.return_text_in_logprobs, start)
                else:
                    out = {"text": texts[i], "output_ids": [],  # SGLang's clients read both counts in every event
                           "meta_info": {"id": None, "finish_reason": None, "prompt_tokens": len(items[i][0]),
                                         "completion_tokens": c["completion_tokens"],
                                         "cached_tokens": c["cached_tokens"]}}
                if not single:
                    out["index"] = i
                yield _sse(out)

        return _EventStream(await _start_streams(svc, items), events)

    outs = await _unless_disconnected(request, svc.run_all(items, keep_failures=True))
    if single and isinstance(outs[0], BaseException):
        raise outs[0]
    results = [_native_result(svc, out, req.return_text_in_logprobs, start) if not isinstance(out, BaseException)
               else {"text": "", "output_ids": [], "error": str(out),  # one failure leaves the batch standing
                     "meta_info": {"finish_reason": {"type": "abort", "message": str(out)}}} for out in outs]
    return results[0] if single else results


def _jsonable(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}


def _version() -> str:
    try:
        from .. import __version__

        return __version__
    except Exception:  # pragma: no cover
        return "0"
