"""A compiled segment run whole on the server (POST /v1/programs), for backends with `capabilities.server_plans`
(lmc.RuntimeEndpoint on an lmc server): one HTTP request per segment instead of one or more per call.

The segment's lowered plan goes as data (Plan.to_json), with its program hints by node (the server has no graph
to compute them from), the instance's arguments, the program's sampling defaults and the stream's state (text,
messages, role, variables: where the previous segment and the host code left it); the server runs it with the
plan executor next to the engine (lmc.compiler.hosted) and returns the new state, the values by body operation
(what a resumed trace reads) and the break node it stopped at. The host code after a break runs here, as always;
only data crosses the wire.

A segment that holds code the server cannot run (a nested program, a custom choice method, an image), state that
is not JSON, or a stream that streams tokens to a reader, runs call by call as before (`servable`); one with no
engine work at all runs here without a request.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import fields

from ..backend.usage import Usage, stream_usage
from ..frontend.state import Stream
from ..protocol.hints import instance_id
from .hints import hints_table, table_json
from .lower import BUILTIN_METHODS, Call, Fork, Generate, Plan, Score, _walk_ops


def _json_ok(v) -> bool:
    try:
        json.dumps(v, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def servable(plan: Plan, args: dict, stream: Stream) -> bool:
    """Whether the server can run this segment for this instance (everything it needs is data)."""
    if plan.callees or stream.stream_tokens or stream.images or any(isinstance(o, Call) for o in _walk_ops(plan.ops)):
        return False
    if any(type(m).__name__ not in BUILTIN_METHODS for m in plan.methods.values()):
        return False
    return _json_ok(args) and _json_ok(stream.vars) and _json_ok(_var_meta(stream))


def _calls_the_model(plan: Plan) -> bool:
    """Whether the segment has engine work (a gen, a select, a fork's shared prefix): one without (host state
    only, e.g. what follows a program's last call) runs here, with no request at all."""
    return any(isinstance(o, (Generate, Score, Fork)) for o in _walk_ops(plan.ops))


_PLAN_JSON: dict[int, dict] = {}  # by id(plan), while the plan lives


def _plan_json(plan: Plan) -> dict:
    """plan.to_json(), made once per plan: a lowered plan does not change, and each instance of each segment sends
    it (~0.15 ms for tree_of_thought's first segment on the development machine, about 3x that on a lent GPU
    machine's host, where it delays the request)."""
    data = _PLAN_JSON.get(id(plan))
    if data is None:
        data = _PLAN_JSON[id(plan)] = plan.to_json()
        weakref.finalize(plan, _PLAN_JSON.pop, id(plan), None)
    return data


def _var_meta(stream: Stream) -> dict:
    return {k: v for k, v in stream.meta.items() if not str(k).startswith("_")}


def _sampling(stream: Stream) -> dict:
    d = stream.defaults
    return {f.name: getattr(d, f.name) for f in fields(d) if f.name != "dtype" and getattr(d, f.name) is not None}


async def run_remote(plan: Plan, args: dict, stream: Stream) -> tuple[bool, int | None]:
    """(ran, break node): ran is False when the segment must run here (not servable, or the server has no
    /v1/programs); otherwise the stream holds the segment's result (or its error) and the break it stopped at."""
    if not servable(plan, args, stream) or not _calls_the_model(plan):
        return False, None
    state = {"text": stream.text, "messages": stream.messages, "role": stream.role, "role_begin": stream.role_begin,
             "vars": stream.vars, "meta": _var_meta(stream), "scopes": stream.scopes, "instance": instance_id(stream)}
    body = {"program": _plan_json(plan), "arguments": [args], "sampling": _sampling(stream), "states": [state]}
    if plan.graph is not None:  # the plan's program hints (the server has no graph to compute them from)
        body["hints"] = table_json(hints_table(plan.graph, stream))
    resp = await stream.backend.run_programs(body)
    if resp is None:
        return False, None
    inst = resp["instances"][0]
    _apply(stream, inst)
    if inst.get("error"):
        stream.error = RuntimeError(f"the server failed the program: {inst['error']['message']}")
        return True, None
    return True, (inst.get("break") or {}).get("node")


def _apply(stream: Stream, inst: dict) -> None:
    """The server's result onto the instance's stream: the text it appended, the variables and their meta info,
    the turns, the values by body operation, and the usage."""
    text = inst.get("text", stream.text)
    if text.startswith(stream.text):
        stream.append(text[len(stream.text):])
    else:  # cannot happen with an honest server: the stream's text only grows
        stream.text = text
    stream.messages = list(inst.get("messages") or stream.messages)
    stream.vars.update(inst.get("variables") or {})
    stream.meta.update(inst.get("meta_info") or {})
    st = inst.get("state") or {}
    if "role" in st:
        stream.role, stream.role_begin, stream.scopes = st["role"], st["role_begin"], dict(st.get("scopes") or {})
    for op, values in (inst.get("history") or {}).items():
        stream.record(int(op), {k: (v, m) for k, (v, m) in values.items()})
    u = inst.get("usage") or {}
    usage = Usage(calls=u.get("calls", 0), prompt_tokens=u.get("prompt_tokens", 0),
                  cached_tokens=u.get("cached_tokens", 0), completion_tokens=u.get("completion_tokens", 0))
    stream_usage(stream).add(usage)
    backend = stream.backend
    if hasattr(backend, "usage"):
        with backend._usage_lock:
            backend.usage.add(usage)
