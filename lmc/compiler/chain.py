"""A plan's operations as engine chains: on a backend with `capabilities.engine_chains` (lmc.Local), a run of
extend / generate / score operations on one stream, up to the next host break (a fork, join, branch, break,
call, a set computed from an expression, or an extend that reads a variable the run itself produces), becomes ONE
engine request that keeps its KV from call to call (lmc.runtime.continuation): no return here between the calls,
no re-admission, no re-match.

The texts between the calls are rendered ahead on a scratch copy of the stream (the same `_extend` the executor
runs: constant text, arguments, variables set before the run, role markers), each gen's parameters are what the
stream would give its call (`Stream.call_params`), and each select goes with its choice method and, where the
plan lowered it, its choices' token ids; each call carries its own program hints (the request's `Req.program`
moves on with it). As the engine streams each call's result, the run's operations are
replayed on the real stream in order (`_extend`, `put_gen`, `put_choice`, set, scope), so the stream ends exactly
as the executor's call-by-call run leaves it. Where the engine stops early (`stopped_at`: a prompt past the
context), the rest runs call by call.

A run that reaches a fork after at least one call goes on into it where the fork starts its branches at once and
every branch begins with chain operations: the chain's last step is the fork, each branch the chain of its
leading operations, and the engine spawns the branches as child requests on the parent's KV at the boundary
(lmc.runtime.continuation), with no return here in between. Each branch's results are replayed on its own child
stream (the executor's `_fork` makes the same children); as a branch's chain ends, the rest of its block runs
here as a task, and the join awaits those tasks as it awaits the executor's own branches.
"""
from __future__ import annotations

from ..protocol import ChoicesDecision, capabilities
from ..protocol.hints import instance_id
from ..frontend.state import Stream
from .executor import _block, _extend, _hints, _method, _task, set_value
from .lower import Extend, Fork, Generate, Op, Plan, Scope, Score, SetVar

CHAIN_START = (Extend, Generate, Score)  # what a chain may begin with


def _reads(op: Extend) -> set[str]:
    return {p.var for p in op.parts if p.var is not None}


def _walk(plan: Plan, ops: list[Op], shadow: Stream, stream: Stream, args: dict, text: str,
          produced: set[str]) -> tuple[list[dict], list[Op], int, str, int]:
    """The engine steps of the chain at the head of `ops`, rendered on `shadow`: (steps, the operations walked,
    how many of them end with the last call, the text after that call, the index of the operation it stopped
    at). `text`: the text before the first step's call; `produced` (updated): the variables only the engine
    knows."""
    steps, covered, end, at = [], [], 0, len(ops)
    for i, op in enumerate(ops):
        if isinstance(op, Extend):
            if _reads(op) & produced:
                at = i
                break
            before = len(shadow.text)
            try:
                _extend(op.parts, args, shadow)
            except Exception:  # noqa: BLE001 - it runs (and fails) call by call, where the error belongs
                at = i
                break
            text += shadow.text[before:]
        elif isinstance(op, Generate):
            params = shadow.call_params(op.gen_params())
            if (params.n or 1) != 1:
                at = i
                break
            steps.append({"text": text, "gen": params.engine_params(), "program": _hints(plan, op, shadow)})
        elif isinstance(op, Score):
            try:
                method = _method(plan, op)
            except ValueError:
                at = i
                break
            if method.requires_unconditional_logprobs:
                at = i
                break
            ids = op.token_ids if capabilities(stream.backend).token_id_selects else None
            steps.append({"text": text, "choices": list(op.choices), "token_ids": ids, "method": method,
                          "program": _hints(plan, op, shadow)})
        elif isinstance(op, SetVar) and op.expr is None:
            shadow.vars[op.name] = op.value
        elif isinstance(op, Scope):
            if op.edge == "end":
                produced.add(op.name)  # its value holds the calls' text, which only the engine knows
        else:
            at = i
            break
        covered.append(op)
        if isinstance(op, (Generate, Score)):
            text = ""
            produced.add(op.name)
            shadow.append("\x00")  # stands for the call's text (the shadow's text is never empty after a call)
            end = len(covered)
    return steps, covered, end, text, at


def build(plan: Plan, ops: list[Op], start: int, stream: Stream,
          args: dict) -> tuple[list[dict], list[Op], list[list[Op]] | None]:
    """The engine steps of the chain at ops[start:], the operations it covers (ending with its last call, or
    with the fork it goes on into) and, with a fork, the operations each branch's chain covers."""
    instance_id(stream)  # (made here first, so that the scratch copy's calls carry the stream's own)
    shadow = stream.child()  # scratch: renders the texts between the calls; its history is never written
    produced: set[str] = set()
    steps, covered, end, text, at = _walk(plan, ops[start:], shadow, stream, args, stream.text, produced)
    op = ops[start + at] if start + at < len(ops) else None
    if steps and isinstance(op, Fork) and op.batch:
        branches = []
        for block in op.branches:
            b_steps, b_covered, b_end, *_ = _walk(plan, block, shadow.child(), stream, args, text, set(produced))
            if not b_steps:
                break  # a branch that starts with host work: the fork runs from the executor
            branches.append((b_steps, b_covered[:b_end]))
        else:
            steps.append({"text": "", "branches": [b for b, _ in branches]})
            return steps, covered + [op], [c for _, c in branches]
    return steps, covered[:end], None


def _replay(ops: list[Op], done: int, item: dict | None, stream: Stream, args: dict) -> int:
    """Replay ops[done:] on the stream up to and including the call `item` is the result of (None: up to the
    next call, or the end, exclusive); returns the new position."""
    while done < len(ops):
        op = ops[done]
        if item is None and isinstance(op, (Generate, Score, Fork)):
            return done
        done += 1
        if isinstance(op, Extend):
            _extend(op.parts, args, stream)
        elif isinstance(op, SetVar):
            stream.set_var(op.name, set_value(op, args, stream), op.body_op)
        elif isinstance(op, Scope):
            stream.scope_begin(op.name) if op.edge == "begin" else stream.scope_end(op.name, op.body_op)
        elif isinstance(op, Generate):
            stream.put_gen(op.name, stream.call_params(op.gen_params()), item["text"], item["meta_info"],
                           op.body_op)
            return done
        else:
            stream.put_choice(op.name, ChoicesDecision(item["text"], item["meta_info"]), op.body_op)
            return done
    return done


def _check_end(calls: list[Op], ran: int, final: dict | None) -> None:
    if final is None or (ran < len(calls) and final.get("stopped_at") is None):
        reason = (final or {}).get("meta_info", {}).get("finish_reason")
        raise RuntimeError(f"%{calls[ran].node}: the engine chain ended before this call ({reason})")


def _calls(ops: list[Op]) -> list[Op]:
    return [op for op in ops if isinstance(op, (Generate, Score))]


async def run_chain(plan: Plan, ops: list[Op], start: int, stream: Stream, args: dict, forks: dict) -> int:
    """Run the chain at ops[start:] as one engine request; returns how many operations it ran (0: none, they run
    call by call). A fork it went on into is in `forks` (the executor's: its child streams and branch tasks)."""
    if stream.stream_tokens or stream.images:
        return 0
    steps, covered, branches = build(plan, ops, start, stream, args)
    if not steps:
        return 0
    calls = _calls(covered)
    stream.hints = steps[0]["program"]
    done, final = 0, None  # operations replayed; the engine's final result
    children: list[Stream] = []
    at: list[int] = []  # per branch, its operations replayed
    tasks: list = []
    async for item in stream.backend.chain(steps):
        if "branch" in item:
            if not children:  # the parent's operations up to the fork, then the fork's children
                done = _replay(covered, done, None, stream, args)
                if done != len(covered) - 1:  # (cannot happen: the branches start after the parent's last call)
                    raise RuntimeError(f"%{covered[-1].node}: the fork's branches started before its parent's calls")
                done += 1
                children = [stream.child() for _ in branches]
                at, tasks = [0] * len(branches), [None] * len(branches)
                forks[covered[-1].node] = (children, tasks)
            b = item["branch"]
            if "error" in item:
                raise RuntimeError(f"%{_calls(branches[b])[item['index']].node}: {item['error']}")
            if "index" in item:
                at[b] = _replay(branches[b], at[b], item, children[b], args)
                continue
            _check_end(_calls(branches[b]), sum(isinstance(op, (Generate, Score)) for op in branches[b][:at[b]]),
                       item)
            block = covered[-1].branches[b]
            tasks[b] = _task(children[b], _block(plan, block[at[b]:], children[b], args))  # the branch's rest
            continue
        if "index" not in item:
            final = item
            continue
        if "error" in item:
            raise RuntimeError(f"%{calls[item['index']].node}: {item['error']}")
        done = _replay(covered, done, item, stream, args)
    _check_end(calls, len(_calls(covered[:done])), final)
    if children and any(t is None for t in tasks):
        raise RuntimeError(f"%{covered[-1].node}: the engine chain ended before its fork's branches")
    return done
