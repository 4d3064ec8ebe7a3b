"""Plan executor: runs a traced ProgramGraph directly, one coroutine per program instance on the frontend loop.

No program body runs: each instance walks its graph and queues the nodes' expressions on its streams, so every
instance of a batch is in flight at once and the engine's scheduler sees the whole frontier. It blocks only where
the graph says it must: a fork (the parent's text must be complete), a join, and a branch (it needs the value).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..frontend import choices as choice_methods
from ..frontend.primitives import Gen, GenParams, RoleBegin, RoleEnd, Select, Text
from ..frontend.state import ConcatAppend, ProgramState, Stream, VarRead, VarScopeBegin, VarScopeEnd
from ..ir import ProgramGraph

_METHODS = {type(m).__name__: m for m in (choice_methods.token_length_normalized,
                                          choice_methods.greedy_token_selection,
                                          choice_methods.unconditional_likelihood_normalized)}
_DTYPES = {"int": int, "float": float, "bool": bool, "str": str}


@dataclass
class Plan:
    """What the passes decided for one graph on one backend."""
    commits: dict[int, str] = field(default_factory=dict)  # fork -> shared branch text to commit (prefix_hoist)
    fork_batch: bool = True  # a fork's branches in flight at once, not one after another
    select_tokens: dict[int, list[int]] = field(default_factory=dict)  # select -> choice ids (select_lowering)
    callees: dict[str, Any] = field(default_factory=dict)  # call name -> CompiledProgram (has arun_instance)


def _value(name: str, args: dict, stream: Stream):
    """A variable's value: a called program's outputs live with the instance's arguments (they are not the
    caller's own variables), the rest in the stream."""
    return args[name] if name in args else stream.vars.get(name)


def _render(parts: list[dict], args: dict, stream: Stream) -> str:
    """Text / argument / variable parts (unordered segments, call arguments) as the instance's text."""
    return "".join(p["text"] if "text" in p else str(_value(p.get("arg") or p["var"], args, stream)) for p in parts)


def _expr(g: ProgramGraph, nid: int, args: dict, plan: Plan, stream: Stream):
    node = g.node(nid)
    a = node.attrs
    if node.kind == "text":
        return Text(a["value"])
    if node.kind == "arg":
        return Text(str(args[a["name"]]))
    if node.kind == "var":
        return Text(str(args[a["name"]])) if a["name"] in args else VarRead(a["name"])
    if node.kind == "gen":
        params = dict(a["params"])
        if "dtype" in params:
            params["dtype"] = _DTYPES[params["dtype"]]
        return Gen(a["name"], GenParams(**params))
    if node.kind == "select":
        return Select(a["name"], list(a["choices"]), a["temperature"], _METHODS[a["method"]],
                      plan.select_tokens.get(nid))
    if node.kind == "role_begin":
        return RoleBegin(a["role"])
    if node.kind == "role_end":
        return RoleEnd(a["role"])
    if node.kind == "unordered":
        segments = [_render(seg, args, stream) for seg in a["segments"]]
        return Text("".join(sorted(segments) if a["canonical"] else segments))
    if node.kind == "var_scope":
        return (VarScopeBegin if a["edge"] == "begin" else VarScopeEnd)(a["name"])
    raise ValueError(f"%{nid}: the executor cannot run a {node.kind} node")


def _holds(value, op: str, expected) -> bool:
    *transforms, test = op.split("|")
    for t in transforms:
        value = getattr(str(value), t)()
    if test == "==":
        return value == expected
    if test == "contains":
        return expected in value
    if test == "startswith":
        return str(value).startswith(expected)
    if test == "endswith":
        return str(value).endswith(expected)
    if test == "nonempty":
        return bool(value)
    raise ValueError(f"unknown branch test {op!r}")


async def _idle(stream: Stream) -> None:
    await asyncio.wrap_future(stream.when_idle())


async def _walk(g: ProgramGraph, start: int | None, stream: Stream, args: dict, plan: Plan) -> None:
    nid = start
    while nid is not None:
        node = g.node(nid)
        nxt = g.successors(nid, "order")
        if node.kind == "fork":
            await _idle(stream)
            if node.attrs["size"] > 1 and stream.text:
                # The hint is not awaited: it reaches the engine before the branches, whose scheduler computes
                # the prefix once and lets the branches find it cached (in-batch prefix dedup), without a round trip.
                asyncio.ensure_future(stream.backend.commit(stream.text + plan.commits.get(nid, "")))
            children = [stream.child() for _ in g.successors(nid, "fork")]
            walks = [_walk(g, (g.successors(item, "order") or [(None, None)])[0][0], child, args, plan)
                     for (item, _), child in zip(g.successors(nid, "fork"), children)]
            if plan.fork_batch:  # fork batching: every branch is in flight at once
                await asyncio.gather(*walks)
            else:
                for walk, child in zip(walks, children):
                    await walk
                    await _idle(child)
            join = nxt[0][0]
            await _join(g.node(join).attrs["mode"], stream, children)
            nid = (g.successors(join, "order") or [(None, None)])[0][0]
            continue
        if node.kind == "call":
            await _idle(stream)  # its arguments may read variables
            if stream.error is not None:
                return
            await _call(node.attrs, stream, args, plan)
            nid = nxt[0][0] if nxt else None
            continue
        if node.kind == "branch":
            await _idle(stream)
            if stream.error is not None:
                return
            taken = "true" if _holds(_value(node.attrs["var"], args, stream), node.attrs["op"], node.attrs["value"]) \
                else "false"
            nid = next((d for d, a in nxt if a.get("when") == taken), None)
            continue
        if node.kind != "fork_item":
            stream.submit(_expr(g, nid, args, plan, stream))
        nid = nxt[0][0] if nxt else None


async def _call(a: dict, stream: Stream, args: dict, plan: Plan) -> None:
    """Run the called program as its own instance (its text is not the caller's); its variables become values
    "<call name>.<variable>" of this instance."""
    if a["name"] not in plan.callees:
        raise ValueError(f"call {a['name']}: the callee program is unknown (a graph loaded from text cannot run calls)")
    kwargs = {k: v["value"] if isinstance(v, dict) else _render(v, args, stream) for k, v in a["args"].items()}
    try:
        result = await plan.callees[a["name"]].arun_instance(kwargs, stream.backend, stream.defaults)
    except Exception as e:  # the interpreter raises; the plan executor records the error on the state
        stream.error = e
        return
    if result.error() is not None:
        stream.error = result.error()
        return
    for k, v in result.variables().items():
        args[f"{a['name']}.{k}"] = v


async def _join(mode: str, parent: Stream, children: list[Stream]) -> None:
    for c in children:
        await _idle(c)
    if mode == "gather_variable":
        inherited = set(parent.vars)
        for c in children:
            if c.error is not None and parent.error is None:
                parent.error = c.error
        for k in dict.fromkeys(k for c in children for k in c.vars if k not in inherited):
            parent.vars[k] = [c.vars.get(k) for c in children]
            parent.meta[k] = [c.meta.get(k) for c in children]
    else:
        parent.submit(ConcatAppend(children))


async def run_graph(g: ProgramGraph, args: dict, backend, defaults: GenParams, plan: Plan,
                    num_api_spec_tokens: int | None = None) -> ProgramState:
    stream = Stream(backend, defaults, num_api_spec_tokens=num_api_spec_tokens)
    roots = [r for r in g.roots() if g.node(r).stream == 0]
    await _walk(g, roots[0] if roots else None, stream, args, plan)
    await _idle(stream)
    return ProgramState(stream)
