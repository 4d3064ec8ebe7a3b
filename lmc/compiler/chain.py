"""A plan's operations as engine chains: on a backend with `capabilities.engine_chains` (lmc.Local), a run of
extend / generate / score operations on one stream, up to the next host break (a fork, join, branch, break,
call, or an extend that reads a variable the run itself produces), becomes ONE engine request that keeps its KV
from call to call (lmc.runtime.continuation): no return here between the calls, no re-admission, no re-match.

The texts between the calls are rendered ahead on a scratch copy of the stream (the same `_extend` the executor
runs: constant text, arguments, variables set before the run, role markers), each gen's parameters are what the
stream would give its call (`Stream.call_params`), and each select goes with its choice method and, where the
plan lowered it, its choices' token ids; each call carries its own program hints (the request's `Req.program`
moves on with it). As the engine streams each call's result, the run's operations are
replayed on the real stream in order (`_extend`, `put_gen`, `put_choice`, set, scope), so the stream ends exactly
as the executor's call-by-call run leaves it. Where the engine stops early (`stopped_at`: a prompt past the
context), the rest runs call by call.
"""
from __future__ import annotations

from ..protocol import ChoicesDecision, capabilities
from ..protocol.hints import instance_id
from ..frontend.state import Stream
from .executor import _extend, _hints, _method
from .lower import Extend, Generate, Op, Plan, Scope, Score, SetVar

CHAIN_START = (Extend, Generate, Score)  # what a chain may begin with


def _reads(op: Extend) -> set[str]:
    return {p.var for p in op.parts if p.var is not None}


def build(plan: Plan, ops: list[Op], start: int, stream: Stream, args: dict) -> tuple[list[dict], list[Op]]:
    """The engine steps of the chain at ops[start:] and the operations it covers (ending with its last call)."""
    instance_id(stream)  # (made here first, so that the scratch copy's calls carry the stream's own)
    shadow = stream.child()  # scratch: renders the texts between the calls; its history is never written
    text, steps, covered, produced, end = stream.text, [], [], set(), 0
    for op in ops[start:]:
        if isinstance(op, Extend):
            if _reads(op) & produced:
                break
            before = len(shadow.text)
            try:
                _extend(op.parts, args, shadow)
            except Exception:  # noqa: BLE001 - it runs (and fails) call by call, where the error belongs
                break
            text += shadow.text[before:]
        elif isinstance(op, Generate):
            params = shadow.call_params(op.gen_params())
            if (params.n or 1) != 1:
                break
            steps.append({"text": text, "gen": params.engine_params(), "program": _hints(plan, op, shadow)})
        elif isinstance(op, Score):
            try:
                method = _method(plan, op)
            except ValueError:
                break
            if method.requires_unconditional_logprobs:
                break
            ids = op.token_ids if capabilities(stream.backend).token_id_selects else None
            steps.append({"text": text, "choices": list(op.choices), "token_ids": ids, "method": method,
                          "program": _hints(plan, op, shadow)})
        elif isinstance(op, SetVar):
            shadow.vars[op.name] = op.value
        elif isinstance(op, Scope):
            if op.edge == "end":
                produced.add(op.name)  # its value holds the calls' text, which only the engine knows
        else:
            break
        covered.append(op)
        if isinstance(op, (Generate, Score)):
            text = ""
            produced.add(op.name)
            shadow.append("\x00")  # stands for the call's text (the shadow's text is never empty after a call)
            end = len(covered)
    return steps, covered[:end]


async def run_chain(plan: Plan, ops: list[Op], start: int, stream: Stream, args: dict) -> int:
    """Run the chain at ops[start:] as one engine request; returns how many operations it ran (0: none, they run
    call by call)."""
    if stream.stream_tokens or stream.images:
        return 0
    steps, covered = build(plan, ops, start, stream, args)
    if not steps:
        return 0
    calls = [op for op in covered if isinstance(op, (Generate, Score))]
    stream.hints = steps[0]["program"]
    done, final = 0, None  # operations replayed; the engine's final result
    async for item in stream.backend.chain(steps):
        if "index" not in item:
            final = item
            continue
        if "error" in item:
            raise RuntimeError(f"%{calls[item['index']].node}: {item['error']}")
        while True:  # replay up to and including the call this segment is the result of
            op = covered[done]
            done += 1
            if isinstance(op, Extend):
                _extend(op.parts, args, stream)
            elif isinstance(op, SetVar):
                stream.set_var(op.name, op.value, op.body_op)
            elif isinstance(op, Scope):
                stream.scope_begin(op.name) if op.edge == "begin" else stream.scope_end(op.name, op.body_op)
            elif isinstance(op, Generate):
                stream.put_gen(op.name, stream.call_params(op.gen_params()), item["text"], item["meta_info"],
                               op.body_op)
                break
            else:
                stream.put_choice(op.name, ChoicesDecision(item["text"], item["meta_info"]), op.body_op)
                break
    ran = sum(isinstance(op, (Generate, Score)) for op in covered[:done])
    if final is None or (ran < len(calls) and final.get("stopped_at") is None):
        reason = (final or {}).get("meta_info", {}).get("finish_reason")
        raise RuntimeError(f"%{calls[ran].node}: the engine chain ended before this call ({reason})")
    return done
