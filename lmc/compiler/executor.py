"""Plan executor: runs a lowered segment (lmc.compiler.lower.Plan) against the backend, one coroutine per program
instance on the frontend loop.

No program body runs and no DSL expression is built: each operation is one call of the stream's primitives
(`Stream.append`, `generate`, `score`, ...), which keep the program state (text, variables, meta info, role
turns) exactly as the interpreter's expressions do. Every instance of a batch is in flight at once, so the
engine's scheduler sees the whole frontier. An instance waits only where the plan says it must: a generate or
score (its value), a join (its branches), a branch (its test), a break (the segment ends there). On a backend
that runs chains of calls as one engine request, each run of calls between host breaks is one (compiler.chain). Every value an
operation produces is recorded under the body operation it came from (`Stream.history`), which is what a resumed
trace replays. Each generate and score runs with its program hints (lmc.compiler.hints, from the plan's graph)
as `stream.hints`, which backends send with the request (lmc.protocol.current_hints).
"""
from __future__ import annotations

import asyncio

from ..protocol import (capabilities, greedy_token_selection, token_length_normalized,
                        unconditional_likelihood_normalized)
from ..protocol.backend import SpecStep, set_current_stream
from ..frontend.primitives import render_unordered
from ..frontend.state import Stream
from ..ir.expr import evaluate, is_expr
from .hints import hints_table, request_hints
from .lower import Branch, Break, Call, Extend, Fork, Generate, Join, Op, Part, Plan, Scope, Score, SetVar
from .values import apply_transforms, holds

METHODS = {type(m).__name__: m for m in (token_length_normalized, greedy_token_selection,
                                         unconditional_likelihood_normalized)}
_OUTSIDE_GROUPS = SpecStep()  # a planned gen in no speculation group: a normal call


def _value(name: str, args: dict, stream: Stream):
    """A variable's value: a called program's outputs ("<call name>.<variable>") live with the instance's
    arguments (they are not the caller's own variables), the rest in the stream."""
    if "." in name and name in args:
        return args[name]
    if name not in stream.vars:
        raise KeyError(f"variable {name!r} is not defined; defined variables: {sorted(map(str, stream.vars))}")
    return stream.vars[name]


def _part_value(p: Part, args: dict, stream: Stream):
    value = args[p.arg] if p.arg is not None else _value(p.var, args, stream)
    return apply_transforms(value if p.index is None else value[p.index], p.transforms)


def _render(parts: list[Part], args: dict, stream: Stream) -> str:
    """Text / argument / variable parts (call arguments, an unordered segment) as the instance's text."""
    return "".join(p.text if p.text is not None else str(_part_value(p, args, stream)) for p in parts)


def _computed(e, args: dict, stream: Stream):
    """An expression's value (lmc.ir.expr) on the instance; a constant as it is."""
    if not is_expr(e):
        return e
    return evaluate(e, lambda name: _value(name, args, stream), lambda name: stream.meta.get(name))


def set_value(op: SetVar, args: dict, stream: Stream):
    """What a set operation sets: its value, or its expression's."""
    return op.value if op.expr is None else _computed(op.expr, args, stream)


def _extend(parts: list[Part], args: dict, stream: Stream) -> None:
    for p in parts:
        if p.role is not None:
            (stream.begin_role if p.edge == "begin" else stream.end_role)(p.role)
        elif p.unordered is not None:
            stream.append(render_unordered([_render(seg, args, stream) for seg in p.unordered]))
        else:
            stream.append(_render([p], args, stream))


def _method(plan: Plan, op: Score):
    method = plan.methods.get(op.node) or METHODS.get(op.method)
    if method is None:
        raise ValueError(f"score %{op.node}: choice method {op.method!r} is not one of lmc's ({sorted(METHODS)}), "
                         "and this plan does not carry the object (a plan loaded from data)")
    return method


def _hints(plan: Plan, op: Op, stream: Stream):
    """The program hints of an LM call: from the plan's graph, or the table a plan loaded from data came with
    (None without either)."""
    table = plan.hints if plan.graph is None else hints_table(plan.graph, stream)
    return None if table is None else request_hints(table, op.node, stream, plan.program)


def _task(stream: Stream, coro) -> asyncio.Task:
    """Run `coro` as its own task with `stream` as the current one (backends account usage to it)."""
    async def run():
        set_current_stream(stream)
        return await coro
    return asyncio.ensure_future(run())


async def _block(plan: Plan, ops: list[Op], stream: Stream, args: dict) -> Break | None:
    """Run a block of operations on one stream; returns the break reached, if any. An error stops the block
    and is recorded on the stream (as the interpreter records it on the state)."""
    forks: dict[int, tuple[list[Stream], list[asyncio.Task]]] = {}
    chains = capabilities(stream.backend).engine_chains
    if chains:
        from .chain import CHAIN_START, run_chain  # (it builds on this module)
    skip = 0
    for i, op in enumerate(ops):
        if skip:  # run by the engine chain before
            skip -= 1
            continue
        if stream.error is not None:
            return None
        stream.hints = None  # only a generate or score has hints (a fork's prefill hint, say, is no program call)
        try:
            if chains and isinstance(op, CHAIN_START) and (ran := await run_chain(plan, ops, i, stream, args, forks)):
                skip = ran - 1  # a run of calls as one engine request (lmc.compiler.chain)
            elif isinstance(op, Extend):
                _extend(op.parts, args, stream)
            elif isinstance(op, Generate):
                stream.hints = _hints(plan, op, stream)
                spec = (op.spec or _OUTSIDE_GROUPS) if plan.speculation_tokens else None
                await stream.generate(op.name, op.gen_params(), op.body_op, spec)
            elif isinstance(op, Score):
                stream.hints = _hints(plan, op, stream)
                await stream.score(op.name, op.choices, op.temperature, _method(plan, op), op.body_op, op.token_ids,
                                   op.prefill)
            elif isinstance(op, SetVar):
                stream.set_var(op.name, set_value(op, args, stream), op.body_op)
            elif isinstance(op, Scope):
                stream.scope_begin(op.name) if op.edge == "begin" else stream.scope_end(op.name, op.body_op)
            elif isinstance(op, Fork):
                forks[op.node] = await _fork(plan, op, stream, args)
            elif isinstance(op, Join):
                children, tasks = forks.pop(op.fork)
                await asyncio.gather(*tasks)
                stream.gather(children, op.body_op) if op.mode == "gather_variable" else stream.concat(children)
            elif isinstance(op, Call):
                await _call(plan, op, stream, args)
            elif isinstance(op, Branch):
                subject = _value(op.var, args, stream) if isinstance(op.var, str) else _computed(op.var, args, stream)
                taken = holds(subject, op.test, _computed(op.value, args, stream))
                return await _block(plan, op.then if taken else op.otherwise, stream, args)
            elif isinstance(op, Break):
                return op
        except Exception as e:  # noqa: BLE001 - the program's failure, kept on its state
            stream.error = e
            return None
    return None


async def _fork(plan: Plan, op: Fork, stream: Stream, args: dict) -> tuple[list[Stream], list[asyncio.Task]]:
    """Start the branches (all at once, or one after another without fork batching); the join awaits them."""
    if op.prefill and len(op.branches) > 1 and stream.text:
        # The hint (planned only where the backend does not share prefixes in a batch itself: lower) is not
        # awaited: it reaches the backend before the branches, which find it cached, without a round trip.
        asyncio.ensure_future(stream.backend.commit(stream.text + op.commit))
    children = [stream.child() for _ in op.branches]
    tasks = []
    for block, child in zip(op.branches, children):
        tasks.append(_task(child, _block(plan, block, child, args)))
        if not op.batch:
            await tasks[-1]
    return children, tasks


async def _call(plan: Plan, op: Call, stream: Stream, args: dict) -> None:
    """Run the called program as its own instance (its text is not the caller's); its variables become values
    "<call name>.<variable>" of this instance."""
    if op.name not in plan.callees:
        raise ValueError(f"call %{op.node} {op.name}: the callee program is unknown (a plan loaded from data "
                         "cannot run calls)")
    kwargs = {**{k: _render(v, args, stream) for k, v in op.text_args.items()}, **op.values}
    result = await plan.callees[op.name].arun_instance(kwargs, stream.backend, stream.defaults)
    if result.error() is not None:
        raise result.error()
    outputs = {f"{op.name}.{k}": v for k, v in result.variables().items()}
    args.update(outputs)
    stream.record(op.body_op, {k: (v, None) for k, v in outputs.items()})


async def run_segment(plan: Plan, args: dict, stream: Stream) -> int | None:
    """Run one segment's plan on an instance's stream (fresh, or where the previous segment's break left it);
    returns the node of the break it stopped at (None: the program is done, or failed: see stream.error).
    On a backend that runs plans server-side, the whole segment is one request where it can be (compiler.remote)."""
    if capabilities(stream.backend).server_plans:
        from .remote import run_remote  # (it builds on this module)

        ran, brk = await run_remote(plan, args, stream)
        if ran:
            return brk
    brk = await _task(stream, _block(plan, plan.ops, stream, args))
    return None if brk is None else brk.node
