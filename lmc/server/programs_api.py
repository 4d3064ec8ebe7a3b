"""POST /v1/programs: whole compiled programs (segments, at graph breaks) run next to the engine, one HTTP request
for all of a call's instances.

    {"program": <a lowered plan's JSON, or .lmir text or graph JSON>, "arguments": [{...}, ...],
     "sampling": {...}, "stream": false, "states": [{...}, ...], "ops": {"<node>": <body operation>},
     "hints": {"<node>": {...}}}

One entry of `arguments` per instance; `sampling` holds the program-level sampling defaults (lmc's GenParams
names); `states` (optional, one per instance) resumes instances where a previous segment's break left them, after
the client ran its host code; `ops` (for a graph; a plan's operations carry theirs) maps nodes to the body
operations their values are recorded under (what the client's resumed trace reads, returned as `history`);
`hints` (with a plan) its program hints by node (lmc.compiler.hints.table_json). The response holds each
instance's variables, meta info, text, messages and usage (and `break` / `state` / `history` at a break), or, with
`"stream": true`, the same as server-sent events, each as it happens:

    data: {"id": "prog-…", "object": "program.variable", "created": …, "program": "chain", "index": 0,
           "variable": "fact0", "value": " Tea is …", "meta_info": {…}}        (each variable, as it is set)
    data: {"id": "prog-…", "object": "program.instance", "created": …, "program": "chain", "index": 0,
           "variables": {…}, "meta_info": {…}, "text": …, "messages": […], "usage": {…}, "break": …,
           "state": {…}, "history": {…}, "error": …}                        (the instance's result, as it ends)
    data: [DONE]                                                            (after every instance's result)

A variable's event comes from the engine as it produces it (an engine chain streams each call's result as the
call ends: lmc.runtime.continuation), not when the instance ends. An instance's variable events come in the
order it sets them (program order; a fork's branches reach it at the join, as lists), all before its result;
events of different instances interleave. `meta_info` is the variable's as in the result (a gen's finish
reason and token counts, a select's logprobs; null for a set or a scope). An instance that fails streams the
variables it set, then its result with `error`. Errors are per instance (`error`): one failing instance leaves
the others standing.
A program the server will not run is a 400 naming the node or the limit (compiler.hosted.ProgramLimits).
Nothing a program holds is code (compiler.hosted).
"""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..compiler.hosted import (ProgramLimits, ProgramRejected, check_arguments, check_program, load_program,
                               load_hints, program_defaults, program_name, run_instances)
from .protocol import ApiError, error_body
from .service import Service, load_object
from .sse import sse, unless_disconnected

__all__ = ["ProgramLimits", "router"]
log = logging.getLogger(__name__)
# Bodies up to this size are parsed and checked on the event loop (tree_of_thought's 3 KB plan: ~0.4 ms on the
# 2-core development machine), larger ones in the worker pool.
INLINE_PARSE_BYTES = 16 << 10
_FIELDS = {"program", "arguments", "sampling", "stream", "states", "ops", "hints", "model"}


def _prepare(raw: bytes, limits: ProgramLimits):
    """(body, program, arguments, defaults, states, ops, hints) of a call, checked (in the worker pool: it
    parses)."""
    body = load_object(raw)
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; /v1/programs takes {sorted(_FIELDS)}", unknown[0])
    if "program" not in body:
        raise ApiError(400, "program is required: a lowered plan's JSON, or the program's graph (.lmir text or its "
                       "JSON)", "program")
    try:
        program = load_program(body["program"])
        arguments = check_arguments(program, body.get("arguments", [{}]))
        defaults = program_defaults(body.get("sampling"))
        check_program(program, limits, defaults, len(arguments))
        hints = load_hints(program, body.get("hints"))
    except ProgramRejected as e:
        raise ApiError(400, str(e), e.field) from None
    states = body.get("states")
    if states is not None and (not isinstance(states, list) or len(states) != len(arguments)
                               or not all(isinstance(s, dict) for s in states)):
        raise ApiError(400, "states must be a list of objects, one per instance", "states")
    ops = body.get("ops") or {}
    try:
        ops = {int(k): int(v) for k, v in ops.items()}
    except (AttributeError, TypeError, ValueError):
        raise ApiError(400, "ops must map node ids to body operation numbers", "ops") from None
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be true or false", "stream")
    return body, program, arguments, defaults, states, ops, hints


def router(svc: Service, limits: ProgramLimits) -> APIRouter:
    r = APIRouter()
    backend = None

    def local():
        from ..backend.local import Local

        return Local(engine=svc.engine)

    @r.post("/v1/programs")
    async def programs(request: Request):
        nonlocal backend
        # A call's latency is what this route is for: a small body is parsed here, a large one in one trip to the
        # worker pool (a thread hop each way, which cost more than parsing a small plan)
        raw = await request.body()
        if len(raw) <= INLINE_PARSE_BYTES:
            body, program, arguments, defaults, states, ops, hints = _prepare(raw, limits)
        else:
            body, program, arguments, defaults, states, ops, hints = await svc.offload(_prepare, raw, limits)
        if backend is None:  # the engine as a program backend (lmc.Local), made on first use
            backend = await svc.offload(local)
        svc.admit(len(arguments))
        pid, created, start = f"prog-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()
        head = {"id": pid, "object": "program.instance", "created": created, "program": program_name(program)}
        streamed = bool(body.get("stream"))
        runs = run_instances(program, arguments, backend, defaults, states, ops, hints, variables=streamed)

        if streamed:
            async def events():
                try:
                    async for i, item in runs:
                        kind = "program.variable" if "variable" in item else "program.instance"
                        yield sse({**head, "object": kind, "index": i, **item})
                except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
                    log.exception("a streamed program failed")
                    yield sse(error_body(500, f"{type(e).__name__}: {e}", "server_error"))
                finally:
                    await runs.aclose()
                    svc.pending -= len(arguments)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect():
            out = [None] * len(arguments)
            try:
                async for i, result in runs:
                    out[i] = {"index": i, **result}
            finally:
                await runs.aclose()
            return out

        try:
            instances = await unless_disconnected(request, collect())
        finally:
            svc.pending -= len(arguments)
        usage = {k: sum(x["usage"][k] for x in instances) for k in instances[0]["usage"]}
        return JSONResponse({"id": pid, "object": "program.run", "created": created,  # plain JSON, sent as is
                             "program": program_name(program), "instances": instances, "usage": usage,
                             "latency": time.perf_counter() - start})

    return r
