"""Programs sent as data (POST /v1/programs): load a program, check it against the server's limits, and run its
instances with the plan executor on a local backend, next to the engine.

The program is data, in one of three forms: a lowered plan's JSON (lmc.compiler.lower.Plan.to_json, what
`lmc compile --emit plan --format json` writes and lmc.RuntimeEndpoint sends), validated by `Plan.from_json`; or a
segment graph in the .lmir text format or its JSON (lmc.ir.export.graph_dict), lowered here for the local engine.
Nothing in it is code: operations and node kinds come from fixed vocabularies, str transforms and branch tests
from fixed tables, and what would run code (a nested program `call`, a select with a custom choice method) is
refused. A program with a break runs up to the break: the instance's state comes back, the client runs its host
code and sends the next segment with that state (`states`).

    program = load_program(body["program"])          # ProgramRejected naming the problem
    check_program(program, limits, sampling, len(arguments))
    async for index, result in run_instances(program, arguments, backend, sampling): ...
    async for index, item in run_instances(..., variables=True): ...  # also each variable as it is set
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any, AsyncIterator, Callable

from ..backend.usage import program_usage
from ..frontend.program import resolve_defaults
from ..frontend.state import ProgramState, Stream, frontend_loop
from ..ir import IRValidationError, ProgramGraph
from ..ir.export import graph_from_dict
from ..ir.text import parse_graph
from ..passes import constant_prefix
from ..protocol import GenParams, capabilities
from ..protocol.hints import INSTANCE_KEY
from .executor import run_segment
from .hints import NodeHints, table_from_json
from .lower import (_DTYPES, BUILTIN_METHODS, Break, Call, Extend, Fork, Generate, Part, Plan, PlanError, Score,
                    _walk_ops, lower)
from .pipeline import PassManager, Target
from .symbols import _STR_TRANSFORMS
from .values import TESTS

_GEN_PARAMS = {f.name for f in fields(GenParams)}
_STATE_KEYS = ("text", "messages", "role", "role_begin", "vars", "meta", "scopes", "instance")


class ProgramRejected(ValueError):
    """A program (or call) the server will not run: `field` is the body field, the message names the node."""

    def __init__(self, message: str, field: str = "program"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ProgramLimits:
    """What one /v1/programs call may ask for (server flags); beyond them the call is a 4xx naming the limit."""

    max_nodes: int = 4096  # nodes in the program's graph
    max_fork_width: int = 64  # branches of one fork
    max_total_tokens: int = 1 << 18  # upper bound of generated tokens, summed over the call's instances
    max_instances: int = 256  # entries in `arguments`


def load_program(data: Any) -> ProgramGraph | Plan:
    """The program of `data`: a Plan (plan JSON: an object with "ops"), or a segment graph (.lmir text, or graph
    JSON); ProgramRejected naming what is malformed (for a plan, the operation). A plan is shared by the calls
    that send the same JSON (_plan_of): run_instances gives each call its own copy with its hints."""
    try:
        if isinstance(data, dict) and "ops" in data:
            text = json.dumps(data, sort_keys=True)
            return _plan_of(text) if len(text) <= PLAN_CACHE_MAX_CHARS else Plan.from_json(text)
        if isinstance(data, str):
            return parse_graph(data)
        if isinstance(data, dict):
            return graph_from_dict(data)
    except (IRValidationError, PlanError) as e:
        raise ProgramRejected(f"program: {e}") from None
    raise ProgramRejected("program must be a lowered plan's JSON, or the program's graph: .lmir text or its JSON")


PLAN_CACHE_MAX_CHARS = 1 << 16  # larger plans are read each time: the cache holds at most 64 x 64 KB of text


@lru_cache(maxsize=64)
def _plan_of(text: str) -> Plan:
    """The validated plan of a plan's JSON text, read once: every instance of every segment of a deployed program
    sends the same plan, whose reading cost ~0.35 ms (tree_of_thought's first segment, on the development
    machine) on the route's event loop. Malformed plans raise, and are not kept."""
    return Plan.from_json(text)


def program_defaults(sampling: Any) -> GenParams:
    """The call's sampling defaults (GenParams fields); ProgramRejected naming an unknown or mistyped one."""
    if sampling is None:
        sampling = {}
    if not isinstance(sampling, dict):
        raise ProgramRejected("sampling must be an object of sampling parameters", "sampling")
    unknown = sorted(set(sampling) - (_GEN_PARAMS - {"dtype"}))
    if unknown:
        raise ProgramRejected(f"sampling: unknown parameter(s) {unknown}; they are {sorted(_GEN_PARAMS - {'dtype'})}",
                              "sampling")
    mnt = sampling.get("max_new_tokens")
    if mnt is not None and (not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 0):
        raise ProgramRejected(f"sampling.max_new_tokens must be a non-negative integer, got {mnt!r}", "sampling")
    return resolve_defaults(sampling)


def _check_counts(where: str, params: dict) -> None:
    for k in ("max_new_tokens", "n"):
        v = params.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ProgramRejected(f"{where}: {k} must be a non-negative integer")


def _check_node(g: ProgramGraph, nid: int, limits: ProgramLimits) -> None:
    node, a = g.node(nid), g.node(nid).attrs
    where = f"%{nid} ({node.kind})"
    if node.kind in ("call", "image"):
        raise ProgramRejected(f"{where}: {'a nested program is code' if node.kind == 'call' else 'images'} cannot "
                              "run on the server; run this program client-side")
    if node.kind == "fork":
        if not isinstance(a["size"], int) or a["size"] < 1:
            raise ProgramRejected(f"{where}: size must be a positive integer")
        if a["size"] > limits.max_fork_width:
            raise ProgramRejected(f"{where}: a fork of {a['size']} branches is wider than this server's limit of "
                                  f"{limits.max_fork_width} (max_fork_width)")
    if node.kind == "gen":
        p = a["params"]
        if not isinstance(p, dict) or set(p) - _GEN_PARAMS:
            raise ProgramRejected(f"{where}: params must be an object of {sorted(_GEN_PARAMS)}")
        if "dtype" in p and p["dtype"] not in _DTYPES:
            raise ProgramRejected(f"{where}: dtype must be one of {sorted(_DTYPES)}")
        _check_counts(where, p)
    if node.kind == "select":
        if not isinstance(a["choices"], list) or not a["choices"] or not all(isinstance(c, str) for c in a["choices"]):
            raise ProgramRejected(f"{where}: choices must be a non-empty list of strings")
        if a["method"] not in BUILTIN_METHODS:
            raise ProgramRejected(f"{where}: choice method {a['method']!r} is not one of {sorted(BUILTIN_METHODS)}")
    transforms = list(a.get("transforms", ())) + (a["op"].split("|")[:-1] if node.kind == "branch" else [])
    bad = [t for t in transforms if t not in _STR_TRANSFORMS]
    if bad:
        raise ProgramRejected(f"{where}: unknown transform(s) {bad}; they are {list(_STR_TRANSFORMS)}")
    if node.kind == "branch" and a["op"].split("|")[-1] not in TESTS:
        raise ProgramRejected(f"{where}: unknown branch test {a['op']!r}; tests: {list(TESTS)}")


def check_program(program: ProgramGraph | Plan, limits: ProgramLimits, defaults: GenParams, instances: int) -> None:
    """ProgramRejected naming the node (or operation) or limit when the program may not run here (ProgramLimits)."""
    if instances < 1 or instances > limits.max_instances:
        raise ProgramRejected(f"arguments: {instances} instances; one call runs 1 to {limits.max_instances} "
                              "(max_instances)", "arguments")
    if isinstance(program, Plan):
        return _check_plan(program, limits, defaults, instances)
    g = program
    if len(g) > limits.max_nodes:
        raise ProgramRejected(f"program: {len(g)} nodes, more than this server's limit of {limits.max_nodes} "
                              "(max_nodes)")
    for nid in g.order():
        _check_node(g, nid, limits)
    gens = [(nid, g.node(nid).attrs["name"], _most_tokens(g.node(nid).attrs["params"], defaults))
            for nid in g.order() if g.node(nid).kind == "gen"]
    _check_budget(gens, g.count("select"), limits, instances)


def _most_tokens(params: dict, defaults: GenParams) -> int:
    """The most tokens one gen with these options generates."""
    return (params.get("max_new_tokens") or defaults.max_new_tokens or 128) * (params.get("n") or 1)


def _check_budget(gens: list[tuple[int, Any, int]], selects: int, limits: ProgramLimits, instances: int) -> None:
    """gens: (node, name, most tokens) of each gen."""
    per_instance = sum(t for *_, t in gens) + selects
    if per_instance * instances > limits.max_total_tokens:
        top, name, most = max(gens, key=lambda x: x[2])
        raise ProgramRejected(f"program: {instances} instance(s) may generate up to {per_instance} tokens each "
                              f"(%{top} gen {name!r} alone {most}), more than this server's "
                              f"budget of {limits.max_total_tokens} tokens per call (max_total_tokens)")


def _transforms(parts: list[Part]):
    for p in parts:
        yield from p.transforms
        for seg in p.unordered or ():
            yield from _transforms(seg)


def _check_plan(plan: Plan, limits: ProgramLimits, defaults: GenParams, instances: int) -> None:
    """A plan's limits (its structure was validated by Plan.from_json): operations, fork width, token budget;
    a nested call (code) and str transforms beyond the fixed table are refused."""
    if plan.target == "openai":  # its gens may carry API-speculation groups, which only an OpenAI backend runs
        raise ProgramRejected("program: this plan was lowered for the openai target; lower it for local or endpoint")
    ops = list(_walk_ops(plan.ops))
    if len(ops) > limits.max_nodes:
        raise ProgramRejected(f"program: {len(ops)} operations, more than this server's limit of {limits.max_nodes} "
                              "(max_nodes)")
    gens, selects = [], 0
    for o in ops:
        where = f"%{o.node} ({o.KIND})"
        if isinstance(o, Call):
            raise ProgramRejected(f"{where}: a nested program is code and cannot run on the server; run this "
                                  "program client-side")
        if isinstance(o, Fork) and len(o.branches) > limits.max_fork_width:
            raise ProgramRejected(f"{where}: a fork of {len(o.branches)} branches is wider than this server's limit "
                                  f"of {limits.max_fork_width} (max_fork_width)")
        bad = [t for t in _transforms(o.parts if isinstance(o, Extend) else []) if t not in _STR_TRANSFORMS]
        if bad:
            raise ProgramRejected(f"{where}: unknown transform(s) {bad}; they are {list(_STR_TRANSFORMS)}")
        if isinstance(o, Generate):
            _check_counts(where, o.params)
            gens.append((o.node, o.name, _most_tokens(o.params, defaults)))
        selects += isinstance(o, Score)
    _check_budget(gens, selects, limits, instances)


def check_arguments(program: ProgramGraph | Plan, arguments: Any) -> list[dict]:
    """The call's `arguments`: one object per instance holding every parameter of the program."""
    if not isinstance(arguments, list) or not all(isinstance(a, dict) for a in arguments):
        raise ProgramRejected("arguments must be a list of objects, one per instance", "arguments")
    for i, a in enumerate(arguments):
        missing = [p for p in program.params if p not in a]
        if missing:
            raise ProgramRejected(f"arguments[{i}] lacks parameter(s) {missing} of "
                                  f"{program_name(program)}({', '.join(program.params)})",
                                  "arguments")
    return arguments


def load_hints(program: ProgramGraph | Plan, data: Any) -> dict[int, NodeHints] | None:
    """The `hints` of a plan (lmc.compiler.hints.table_json data; a graph's come from the graph itself)."""
    if data is None:
        return None
    if not isinstance(program, Plan):
        raise ProgramRejected("hints go with a plan; a graph's hints are computed from it", "hints")
    try:
        return table_from_json(data)
    except ValueError as e:
        raise ProgramRejected(str(e), "hints") from None


def program_name(program: ProgramGraph | Plan) -> str:
    return program.program if isinstance(program, Plan) else program.name


def local_plan(g: ProgramGraph, backend) -> Plan:
    """The executor's plan for `g` on a local backend: what the pass pipeline decides for it, lowered."""
    target = Target("local", backend.chat_template, getattr(backend, "tokenizer", None), capabilities(backend))
    _, stats = PassManager().run(g, target)
    return lower(g, target, stats)


def _restore(stream: Stream, state: dict) -> None:
    """A resumed instance's stream: where the client's previous segment (and host code) left it."""
    unknown = set(state) - set(_STATE_KEYS)
    if unknown:
        raise ProgramRejected(f"states: unknown field(s) {sorted(unknown)}; a state has {list(_STATE_KEYS)}",
                              "states")
    stream.text = str(state.get("text", ""))
    stream.messages = list(state.get("messages") or [])
    stream.role, stream.role_begin = state.get("role"), int(state.get("role_begin") or 0)
    stream.vars = dict(state.get("vars") or {})
    stream.meta = dict(state.get("meta") or {})
    stream.scopes = {str(k): int(v) for k, v in (state.get("scopes") or {}).items()}
    if state.get("instance"):
        stream.meta[INSTANCE_KEY] = str(state["instance"])


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)


def instance_result(plan: Plan, stream: Stream, brk: int | None) -> dict:
    """What the server returns for one instance: variables (with each one's meta info), text, messages, usage;
    at a break, the break node and the state to resume from (and the values by body operation, for the client's
    resumed trace)."""
    state = ProgramState(stream)
    u = program_usage(state)
    out = {"variables": {k: _jsonable(v) for k, v in stream.vars.items()},
           "meta_info": {k: _jsonable(v) for k, v in stream.meta.items() if not str(k).startswith("_")},
           "text": stream.text, "messages": list(stream.messages),
           "usage": {"calls": u.calls, "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                     "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens},
           "break": None, "error": None}
    if stream.error is not None:
        out["error"] = {"message": f"{type(stream.error).__name__}: {stream.error}", "type": "program_error"}
    if brk is not None:
        op = next(o for o in _walk_ops(plan.ops) if isinstance(o, Break) and o.node == brk)
        out["break"] = {"node": brk, "reason": op.reason, "line": op.line, "resume": op.resume,
                        "interpret": op.interpret}
    out["history"] = {str(op): {k: [_jsonable(v), _jsonable(m)] for k, (v, m) in values.items()}
                      for op, values in (stream.history or {}).items()}
    out["state"] = {"text": stream.text, "messages": list(stream.messages), "role": stream.role,
                    "role_begin": stream.role_begin, "scopes": dict(stream.scopes),
                    "instance": stream.meta.get(INSTANCE_KEY)}
    return out


class _ReportingStream(Stream):
    """An instance's stream that reports each variable as it is set: `on_var(name, value, meta)`, on the frontend
    loop, as the executor (or an engine chain's replay, lmc.compiler.chain, as the engine streams each call's
    result) sets it. Every variable a plan sets goes through `Stream.record` (gens, selects, sets, scopes, joins).
    Its forks (`child`) are plain streams: a branch's variables reach the instance at the join."""

    def __init__(self, backend, defaults: GenParams, on_var: Callable[[str, Any, Any], None]):
        super().__init__(backend, defaults)
        self.on_var = on_var

    def record(self, op: int | None, values: dict[str, tuple]) -> None:
        super().record(op, values)
        for name, (value, meta) in values.items():
            self.on_var(name, value, meta)


def variable_event(name: str, value: Any, meta: Any) -> dict:
    """What the server streams for one variable as it is set: its name, value and meta info (as in the
    instance's result)."""
    return {"variable": name, "value": _jsonable(value), "meta_info": _jsonable(meta)}


async def _instance(plan: Plan, args: dict, backend, defaults: GenParams, state: dict | None,
                    on_var: Callable[[str, Any, Any], None] | None) -> dict:
    stream = Stream(backend, defaults) if on_var is None else _ReportingStream(backend, defaults, on_var)
    stream.history = {}
    if state:
        _restore(stream, state)
    try:
        brk = await run_segment(plan, dict(args), stream)
    except asyncio.CancelledError:
        stream.error = RuntimeError("the client went away")  # what is still queued on the stream does not run
        raise
    except Exception as e:  # noqa: BLE001 - a malformed node at run time fails this instance alone
        stream.error, brk = e, None
    return instance_result(plan, stream, brk)


async def run_instances(program: ProgramGraph | Plan, arguments: list[dict], backend, defaults: GenParams,
                        states: list[dict] | None = None,
                        ops: dict[int, int] | None = None,
                        hints: dict[int, NodeHints] | None = None,
                        variables: bool = False) -> AsyncIterator[tuple[int, dict]]:
    """Run every instance at once on the frontend loop; yields (index, result) as each finishes. Errors are per
    instance (in its result's `error`). Closing the iterator cancels what is still running. `ops`: for a graph,
    the body operation of each node (a plan's operations carry theirs); `hints`: a plan's program hints by node.
    `variables`: also yield (index, variable_event(...)) for each variable as the instance sets it, in the order
    it sets them, all before its result (one queue carries both, in the order the frontend loop made them)."""
    if states is not None and len(states) != len(arguments):
        raise ProgramRejected(f"states: {len(states)} states for {len(arguments)} instances", "states")
    if isinstance(program, Plan):
        plan = replace(program, hints=hints)  # (a copy: the plan itself is shared by the calls that send it)
    else:
        program.op_of.update(ops or {})  # the body operation of each node, under which its values are recorded
        plan = local_plan(program, backend)
    loop, home = frontend_loop(), asyncio.get_running_loop()
    if (plan.batch_prefix and plan.graph is not None and len(arguments) > 1
            and not capabilities(backend).batch_prefix_sharing):
        prefix = constant_prefix(plan.graph, backend.chat_template, arguments)
        if prefix:  # prefilled once ahead of the instances (a hint: not awaited)
            asyncio.run_coroutine_threadsafe(backend.commit(prefix), loop)
    q: asyncio.Queue = asyncio.Queue()  # (index, variable event or the instance's finished future), from the loop

    def put(i: int, item) -> None:
        home.call_soon_threadsafe(q.put_nowait, (i, item))

    def reporter(i: int):
        return (lambda name, value, meta: put(i, variable_event(name, value, meta))) if variables else None

    futures = []
    for i, args in enumerate(arguments):
        f = asyncio.run_coroutine_threadsafe(
            _instance(plan, args, backend, defaults, states[i] if states else None, reporter(i)), loop)
        f.add_done_callback(lambda f, i=i: put(i, f))  # on the frontend loop, after the instance's last variable
        futures.append(f)
    left = len(futures)
    try:
        while left:
            i, item = await q.get()
            if isinstance(item, concurrent.futures.Future):
                left -= 1
                item = item.result()
            yield i, item
    finally:
        for f in futures:
            f.cancel()
