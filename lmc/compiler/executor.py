"""Plan executor: runs a traced segment directly, one coroutine per program instance on the frontend loop.

No program body runs: each instance walks its segment and queues the nodes' expressions on its streams, so every
instance of a batch is in flight at once and the engine's scheduler sees the whole frontier. It blocks only where
the graph says it must: a fork (the parent's text must be complete), a join, a branch (it needs the value), and
a break (the host code needs the values: the segment ends there). Every value a node produces is recorded under
the body operation the node came from (`Stream.history`), which is what a resumed trace replays.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..frontend import choices as choice_methods
from ..frontend.primitives import Gen, GenParams, RoleBegin, RoleEnd, Select, Text, Unordered
from ..frontend.state import ConcatAppend, SetVar, Stream, VarRead, VarScopeBegin, VarScopeEnd
from ..ir import ProgramGraph
from ..protocol import capabilities
from .hints import request_hints
from .values import apply_transforms, holds

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
    batch_prefix: bool = False  # prefill the prefix a batch's instances share once, ahead of them
    callees: dict[str, Any] = field(default_factory=dict)  # call name -> CompiledProgram (has arun_instance)

    def as_dict(self) -> dict:
        """The decisions as JSON data (node ids as "%N"; callees by name)."""
        return {"commits": {f"%{k}": v for k, v in sorted(self.commits.items())}, "fork_batch": self.fork_batch,
                "select_tokens": {f"%{k}": v for k, v in sorted(self.select_tokens.items())},
                "batch_prefix": self.batch_prefix, "callees": sorted(self.callees)}


def _value(name: str, args: dict, stream: Stream):
    """A variable's value: a called program's outputs ("<call name>.<variable>") live with the instance's
    arguments (they are not the caller's own variables), the rest in the stream."""
    return args[name] if "." in name and name in args else stream.vars.get(name)


def _render(parts: list[dict], args: dict, stream: Stream) -> str:
    """Text / argument / variable parts (unordered segments, call arguments) as the instance's text."""
    return "".join(p["text"] if "text" in p else str(args[p["arg"]]) if "arg" in p else
                   str(_value(p["var"], args, stream)) for p in parts)


def _expr(g: ProgramGraph, nid: int, args: dict, plan: Plan, stream: Stream):
    node = g.node(nid)
    a = node.attrs
    if node.kind == "text":
        return Text(a["value"])
    if node.kind == "arg" or node.kind == "var" and "." in a["name"] and a["name"] in args:
        return Text(str(apply_transforms(args[a["name"]], a.get("transforms", ()))))  # an argument or a call output
    if node.kind == "var":
        return VarRead(a["name"], tuple(a.get("transforms", ())))
    if node.kind == "gen":
        params = dict(a["params"])
        if "dtype" in params:
            params["dtype"] = _DTYPES[params["dtype"]]
        return Gen(None if a.get("anonymous") else a["name"], GenParams(**params))
    if node.kind == "select":
        method = g.methods.get(nid) or _METHODS.get(a["method"])
        if method is None:
            raise ValueError(f"%{nid}: choice method {a['method']!r} is not one of lmc's ({sorted(_METHODS)}), and "
                             "this graph does not carry the object (a graph loaded from text)")
        return Select(None if a.get("anonymous") else a["name"], list(a["choices"]), a["temperature"], method,
                      plan.select_tokens.get(nid))
    if node.kind == "role_begin":
        return RoleBegin(a["role"])
    if node.kind == "role_end":
        return RoleEnd(a["role"])
    if node.kind == "unordered":
        return Unordered([_render(seg, args, stream) for seg in a["segments"]])
    if node.kind == "var_scope":
        return (VarScopeBegin if a["edge"] == "begin" else VarScopeEnd)(a["name"])
    if node.kind == "set_var":
        return SetVar(a["name"], a["value"])
    raise ValueError(f"%{nid}: the executor cannot run a {node.kind} node")


async def _idle(stream: Stream) -> None:
    await asyncio.wrap_future(stream.when_idle())


def _first(g: ProgramGraph, nid: int) -> int | None:
    nxt = g.successors(nid, "order")
    return nxt[0][0] if nxt else None


async def _walk(g: ProgramGraph, start: int | None, stream: Stream, args: dict, plan: Plan) -> int | None:
    """Run from `start` to the end of the stream's path; returns the break node reached, if any."""
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
            walks = [_walk(g, _first(g, item), child, args, plan)
                     for (item, _), child in zip(g.successors(nid, "fork"), children)]
            if plan.fork_batch:  # fork batching: every branch is in flight at once
                await asyncio.gather(*walks)
            else:
                for walk, child in zip(walks, children):
                    await walk
                    await _idle(child)
            join = nxt[0][0]
            await _join(g.node(join).attrs["mode"], stream, children, g.op_of.get(join))
            nid = _first(g, join)
            continue
        if node.kind == "call":
            await _idle(stream)  # its arguments may read variables
            if stream.error is not None:
                return None
            await _call(node.attrs, stream, args, plan, g.op_of.get(nid))
            nid = _first(g, nid)
            continue
        if node.kind == "branch":
            await _idle(stream)
            if stream.error is not None:
                return None
            taken = "true" if holds(_value(node.attrs["var"], args, stream), node.attrs["op"], node.attrs["value"]) \
                else "false"
            nid = next((d for d, a in nxt if a.get("when") == taken), None)
            continue
        if node.kind == "break":
            await _idle(stream)
            return nid
        if node.kind != "fork_item":
            expr = _expr(g, nid, args, plan, stream)
            expr.op = g.op_of.get(nid)  # the body operation its values are recorded under
            expr.hints = request_hints(g, nid, stream)  # the plan's program hints for the calls it makes
            stream.submit(expr)
        nid = _first(g, nid)
    return None


async def _call(a: dict, stream: Stream, args: dict, plan: Plan, op: int | None) -> None:
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
    outputs = {f"{a['name']}.{k}": v for k, v in result.variables().items()}
    args.update(outputs)
    stream.record(op, {k: (v, None) for k, v in outputs.items()})


async def _join(mode: str, parent: Stream, children: list[Stream], op: int | None) -> None:
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
            parent.record(op, {k: (parent.vars[k], parent.meta[k])})
    else:
        parent.submit(ConcatAppend(children))


async def run_segment(g: ProgramGraph, args: dict, stream: Stream, plan: Plan) -> int | None:
    """Run one segment on an instance's stream (fresh, or where the previous segment's break left it); returns
    the break node it stopped at (None: the program is done). Waits until the stream is idle."""
    if capabilities(stream.backend).server_plans:  # the whole segment in one request (lmc.compiler.remote)
        from .remote import run_remote  # (it builds on this module)

        ran, brk = await run_remote(g, args, stream, plan)
        if ran:
            return brk
    roots = [r for r in g.roots() if g.node(r).stream == 0]
    brk = await _walk(g, roots[0] if roots else None, stream, args, plan)
    await _idle(stream)
    return brk
