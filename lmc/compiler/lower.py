"""Lowering: an optimized segment graph becomes a Plan, a list of explicit operations for one backend kind.

The operations (one small vocabulary; `Plan.to_json()` / `Plan.from_json()` round-trip them as data, and
`format_plan` prints them):
- extend    append a rendered prefix: constant text, arguments and variables (an item of a gathered one, with
            their str transforms), role markers, order-free segments;
- generate  one gen (its sampling options, stop, constraint, n, dtype), with its place in an API-speculation group
            where the plan has one;
- score     one select: a prefill of the shared prompt, then every choice scored as an extension of it, whatever
            the choices' token lengths; on the local engine, where every choice is one token after the constant
            text before it (or after that text less its last token), the choice ids ride along (one request
            scores them all);
- set       set a variable to a host value, or to an expression's (lmc.ir.expr: computed from the variables and
            meta info it reads); scope: begin / end a var_scope;
- fork      start the branches (each a block of operations on its own copy of the state), after a prefill hint
            of the parent's text plus the text every branch starts with (on a backend that does not share a
            prefix's computation among queued requests itself);
- join      wait for a fork's branches and merge them (gather_variable or concate_and_append);
- call      run a nested program as its own instance;
- branch    test a variable or an expression, against a constant or another expression, and run one of two
            blocks (the rest of the segment lives inside them: traced paths never merge again);
- break     end the segment: the host code runs with concrete values, then the next segment (or the interpreter).

Invariants (checked by `Plan.validate`, which `from_json` runs): a join names a fork started earlier in its block;
fork branches hold no branch or break (the tracer ends a segment outside forks); a break or branch is the last
operation of its block; gen sampling options are GenParams fields; choice token ids, where given, are one per
choice. Every operation names its graph node (`node`) so that errors point at it, and carries the body operation
its values are recorded under (`body_op`: what a resumed trace replays; None for a graph read from text).
In JSON an operation is an object whose "op" names its kind.
"""
from __future__ import annotations

import functools
import json
import types
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

from ..ir import ProgramGraph
from ..ir import expr as ir_expr
from ..protocol import GenParams
from ..protocol.backend import SpecStep
from .values import TESTS

PLAN_VERSION = 1
BUILTIN_METHODS = ("TokenLengthNormalized", "GreedyTokenSelection", "UnconditionalLikelihoodNormalized")
JOIN_MODES = ("gather_variable", "concate_and_append")
ROLES = ("system", "user", "assistant")
_GEN_OPTIONS = tuple(f.name for f in fields(GenParams))
_DTYPES = ("int", "float", "bool", "str")
_TEXT_KINDS = ("text", "arg", "var", "role_begin", "role_end", "unordered")


class PlanError(ValueError):
    """A plan that no executor could run; the message names the operation (its path and node)."""


# ---- the operations ----------------------------------------------------------------------------------------------
@dataclass
class Part:
    """One piece of an extend: exactly one of text / arg / var / role (with edge) / unordered is set."""
    text: str | None = None
    arg: str | None = None
    var: str | None = None
    index: int | None = None  # with var: the item of a gathered variable (a fork's list)
    transforms: list[str] = field(default_factory=list)  # argument-free str methods, applied in order
    role: str | None = None
    edge: str | None = None  # "begin" | "end" (with role)
    unordered: list[list[Part]] | None = None  # segments of text/arg parts, rendered in sorted order

    def check(self) -> str | None:
        kinds = [k for k in ("text", "arg", "var", "role", "unordered") if getattr(self, k) is not None]
        if len(kinds) != 1:
            return f"a part sets exactly one of text, arg, var, role, unordered (this one: {kinds or 'none'})"
        if self.index is not None and (self.var is None or self.index < 0):
            return f"index {self.index}: an item of a variable is read by a non-negative index"
        if self.role is not None and (self.role not in ROLES or self.edge not in ("begin", "end")):
            return f"role part {self.role!r}/{self.edge!r}: the role is one of {ROLES}, the edge begin or end"
        bad = [t for t in self.transforms if not (t.isidentifier() and callable(getattr(str, t, None)))]
        if bad:
            return f"unknown str transform(s) {bad}"
        for seg in self.unordered or ():
            for p in seg:
                if p.text is None and p.arg is None:
                    return "an unordered segment holds text and argument parts only"
        return None


@dataclass
class Op:
    KIND: ClassVar[str] = ""
    node: int  # the graph node it was lowered from (what errors name)

    def check(self) -> str | None:
        """What is wrong with this operation on its own (None: nothing)."""
        return None


@dataclass
class Extend(Op):
    KIND: ClassVar[str] = "extend"
    parts: list[Part] = field(default_factory=list)

    def check(self):
        return next((f"parts[{i}]: {e}" for i, p in enumerate(self.parts) if (e := p.check())), None)


@dataclass
class Generate(Op):
    KIND: ClassVar[str] = "generate"
    body_op: int | None = None
    name: str | None = None  # None: an anonymous gen (appends its text, sets no variable)
    params: dict = field(default_factory=dict)  # GenParams fields that are set (dtype by name)
    spec: SpecStep | None = None  # its place in a planned API-speculation group

    def check(self):
        unknown = sorted(set(self.params) - set(_GEN_OPTIONS))
        if unknown:
            return f"unknown sampling option(s) {unknown}; the options are: {', '.join(_GEN_OPTIONS)}"
        if self.params.get("dtype", "str") not in _DTYPES:
            return f"dtype {self.params['dtype']!r} is not one of {_DTYPES}"
        return None

    def gen_params(self) -> GenParams:
        p = dict(self.params)
        if "dtype" in p:
            p["dtype"] = {"int": int, "float": float, "bool": bool, "str": str}[p["dtype"]]
        return GenParams(**p)


@dataclass
class Score(Op):
    KIND: ClassVar[str] = "score"
    body_op: int | None = None
    name: str | None = None
    choices: list[str] = field(default_factory=list)
    temperature: float = 0.0
    method: str = "TokenLengthNormalized"
    # choice i is this one token after the prompt, or after the prompt less its last token (local fast path)
    token_ids: list[int] | None = None
    prefill: bool = False  # prefill the prompt once before the choices extend it (local engine)

    def check(self):
        if not self.choices:
            return "no choices"
        if self.token_ids is not None and len(self.token_ids) != len(self.choices):
            return f"{len(self.token_ids)} token ids for {len(self.choices)} choices"
        return None


@dataclass
class SetVar(Op):
    KIND: ClassVar[str] = "set"
    body_op: int | None = None
    name: str = ""
    value: Any = None
    expr: Any = None  # an expression (lmc.ir.expr) the value is computed from where it runs; None: `value`

    def check(self):
        return None if self.expr is None else _check_expr("expr", self.expr)


@dataclass
class Scope(Op):
    KIND: ClassVar[str] = "scope"
    body_op: int | None = None
    name: str = ""
    edge: str = "begin"

    def check(self):
        return None if self.edge in ("begin", "end") else f"edge {self.edge!r} is not begin or end"


@dataclass
class Fork(Op):
    KIND: ClassVar[str] = "fork"
    body_op: int | None = None
    commit: str = ""  # text every branch starts with, prefilled with the parent's text (fork_commit)
    batch: bool = True  # every branch in flight at once (fork_batch), else one after another
    branches: list[list[Op]] = field(default_factory=list)
    prefill: bool = True  # send that prefill (the parent's text + commit) before the branches (see lower)

    def check(self):
        for i, block in enumerate(self.branches):
            bad = next((o for o in _walk_ops(block) if isinstance(o, (Branch, Break))), None)
            if bad is not None:
                return f"branch {i} holds a {bad.KIND} (%{bad.node}): segments end and branch on the main stream only"
        return None


@dataclass
class Join(Op):
    KIND: ClassVar[str] = "join"
    body_op: int | None = None
    fork: int = -1  # the node of the fork it joins
    mode: str = "gather_variable"

    def check(self):
        return None if self.mode in JOIN_MODES else f"mode {self.mode!r} is not one of {JOIN_MODES}"


@dataclass
class Call(Op):
    KIND: ClassVar[str] = "call"
    body_op: int | None = None
    name: str = ""  # "<program>#<k>": its variables read as "<name>.<variable>"
    program: str = ""
    text_args: dict[str, list[Part]] = field(default_factory=dict)  # rendered with the caller's values
    values: dict = field(default_factory=dict)  # non-text arguments (numbers, booleans, None)

    def check(self):
        for k, parts in self.text_args.items():
            bad = next((e for p in parts if (e := p.check())), None)
            if bad:
                return f"argument {k!r}: {bad}"
        return None


@dataclass
class Branch(Op):
    KIND: ClassVar[str] = "branch"
    var: Any = ""  # a variable's name, or an expression (lmc.ir.expr)
    test: str = "=="  # "[transform|...]test", test one of lmc.compiler.values.TESTS
    value: Any = None  # a constant, or an expression
    then: list[Op] = field(default_factory=list)
    otherwise: list[Op] = field(default_factory=list)

    def check(self):
        *transforms, test = self.test.split("|")
        if test not in TESTS or not all(callable(getattr(str, t, None)) for t in transforms):
            return f"test {self.test!r}: the form is [transform|...]test, test one of {TESTS}"
        if not isinstance(self.var, str):
            return _check_expr("var", self.var)
        return _check_expr("value", self.value) if ir_expr.is_expr(self.value) else None


@dataclass
class Break(Op):
    KIND: ClassVar[str] = "break"
    reason: str = ""
    line: str = ""
    resume: int = 0  # body operations before it (where tracing resumes)
    interpret: bool = False  # the interpreter runs the rest of the body


OPS: dict[str, type[Op]] = {c.KIND: c for c in (Extend, Generate, Score, SetVar, Scope, Fork, Join, Call, Branch,
                                               Break)}


def _check_expr(field_name: str, e) -> str | None:
    problem = ir_expr.check(e)
    return None if problem is None else f"{field_name}: {problem}"


def _walk_ops(block: list[Op]):
    """Every operation of a block, nested blocks included (pre-order)."""
    for o in block:
        yield o
        for sub in (o.branches if isinstance(o, Fork) else [o.then, o.otherwise] if isinstance(o, Branch) else []):
            yield from _walk_ops(sub)


@dataclass
class Plan:
    """A segment lowered for one backend kind. `to_json()` gives JSON data (stable: `version`), `from_json()`
    reads it back with validation. `callees` and `methods` are runtime only (not data): the compiled programs of
    the calls by name, and the user-defined choice methods by score node."""
    program: str
    target: str  # "local" | "endpoint" | "openai"
    ops: list[Op]
    params: list[str] = field(default_factory=list)
    inputs: list[str] | None = None  # a segment after a break: the variables defined before it
    batch_prefix: bool = False  # prefill the prefix a batch's instances share once, ahead of them
    # num_api_spec_tokens on the OpenAI kind: the generate ops' `spec` is all the speculation there is (none
    # outside the groups)
    speculation_tokens: int | None = None
    callees: dict[str, Any] = field(default_factory=dict, compare=False)
    methods: dict[int, Any] = field(default_factory=dict, compare=False)
    # the segment graph it was lowered from (runtime only: the executor's program hints come from it, via
    # lmc.compiler.hints; None for a plan loaded from data)
    graph: Any = field(default=None, compare=False, repr=False)
    # runtime only: the program hints by node (lmc.compiler.hints.NodeHints) for a plan without its graph
    hints: dict[int, Any] | None = field(default=None, compare=False, repr=False)

    def validate(self) -> "Plan":
        _validate_block(self.ops, "ops", set())
        return self

    # ---- data ----------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"version": PLAN_VERSION, "program": self.program, "target": self.target, "params": self.params,
                "inputs": self.inputs, "batch_prefix": self.batch_prefix,
                "speculation_tokens": self.speculation_tokens, "ops": [_dump(o) for o in self.ops]}

    @classmethod
    def from_json(cls, data) -> "Plan":
        """A plan from `to_json()` data (or its JSON text). Raises PlanError naming what is wrong and where."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except ValueError as e:
                raise PlanError(f"plan: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan: expected a JSON object, not {type(data).__name__}")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"plan: version {data.get('version')!r} is not {PLAN_VERSION} (the version this lmc runs)")
        if data.get("target") not in ("local", "endpoint", "openai"):
            raise PlanError(f"plan: target {data.get('target')!r} is not one of local, endpoint, openai")
        top = {k: v for k, v in data.items() if k != "version"}
        plan = _load(cls, top, _At("plan"), skip=("callees", "methods", "graph", "hints")).validate()
        custom = next((o for o in _walk_ops(plan.ops) if isinstance(o, Score) and o.method not in BUILTIN_METHODS),
                      None)
        if custom is not None:  # plan data carries no code: a user-defined method cannot come with it
            raise PlanError(f"score %{custom.node}: choice method {custom.method!r} is not one of lmc's "
                            f"({', '.join(BUILTIN_METHODS)})")
        return plan


def _dump(v):
    if isinstance(v, Op):
        return {"op": v.KIND, **{f.name: _dump(getattr(v, f.name)) for f in fields(v)}}
    if isinstance(v, (Part, SpecStep)):
        d = {f.name: _dump(getattr(v, f.name)) for f in fields(v)}
        return {k: x for k, x in d.items() if x not in (None, [])} if isinstance(v, Part) else d
    if isinstance(v, list):
        return [_dump(x) for x in v]
    if isinstance(v, dict):
        return {k: _dump(x) for k, x in v.items()}
    return v


class _At:
    """Where a value being loaded sits: the operation that holds it (`base`, its path: what errors name, with
    `label`) and the field path below it."""

    def __init__(self, label: str, base: str = "", path: str = ""):
        self.label, self.base, self.path = label, base, path

    def below(self, key) -> "_At":
        return _At(self.label, self.base, f"{self.path}[{key}]" if isinstance(key, int) else
                   f"{self.path}.{key}" if self.path else key)

    def op_path(self) -> str:
        return f"{self.base}.{self.path}" if self.base else self.path

    def error(self, problem: str) -> PlanError:
        return PlanError(f"{self.label}: {self.path + ': ' if self.path else ''}{problem}")


@functools.cache
def _field_types(cls) -> dict:
    """A plan dataclass's field types, resolved once: its annotations are strings (`from __future__ import
    annotations`), and resolving them compiles each one, a millisecond per plan loaded otherwise."""
    return get_type_hints(cls)


def _load(cls, d, at: _At, skip=()):
    """A dataclass from JSON data, every field's type checked (errors name the operation and the field)."""
    if not isinstance(d, dict):
        raise at.error(f"expected an object, not {type(d).__name__}")
    hints = _field_types(cls)
    names = [f.name for f in fields(cls) if f.name not in skip]
    extra = sorted(set(d) - set(names) - ({"op"} if issubclass(cls, Op) else set()))
    if extra:
        raise at.error(f"unknown field(s) {extra}; the fields are: {', '.join(names)}")
    kwargs = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name not in d:
            if f.default is MISSING and f.default_factory is MISSING:
                raise at.error(f"missing field {f.name!r}")
            continue
        kwargs[f.name] = _typed(d[f.name], hints[f.name], at.below(f.name))
    return cls(**kwargs)


_SCALARS = {int: lambda x: isinstance(x, int) and not isinstance(x, bool), bool: lambda x: isinstance(x, bool),
            str: lambda x: isinstance(x, str), float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)}


def _typed(v, tp, at: _At):
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        return _typed(v, next(a for a in args if a is not type(None)), at)
    if tp is Any:
        return v
    if origin is list:
        if not isinstance(v, list):
            raise at.error(f"must be a list, not {type(v).__name__}")
        if args[0] is Op:
            return [_load_op(x, at.below(i)) for i, x in enumerate(v)]
        return [_typed(x, args[0], at.below(i)) for i, x in enumerate(v)]
    if origin is dict or tp is dict:
        if not isinstance(v, dict):
            raise at.error(f"must be an object, not {type(v).__name__}")
        return {k: _typed(x, args[1], at.below(k)) for k, x in v.items()} if args else dict(v)
    if tp in (Part, SpecStep):
        return _load(tp, v, at)
    if not _SCALARS[tp](v):
        raise at.error(f"must be {tp.__name__}, not {json.dumps(v, default=repr)}")
    return float(v) if tp is float else v


def _load_op(d, at: _At) -> Op:
    """One operation: `at` is where it sits (ops[3], ops[2].branches[0][1], ...)."""
    where = at.op_path()
    if not isinstance(d, dict):
        raise PlanError(f"{where}: an operation is an object, not {type(d).__name__}")
    kind = d.get("op")
    if kind not in OPS:
        raise PlanError(f"{where}: unknown operation {kind!r}; the operations are: {', '.join(OPS)}")
    return _load(OPS[kind], d, _At(f"{where} ({kind} %{d.get('node', '?')})", where))


def _validate_block(block: list[Op], path: str, started: set[int]) -> None:
    for i, o in enumerate(block):
        where = f"{path}[{i}] ({o.KIND} %{o.node})"
        problem = o.check()
        if problem is None and isinstance(o, Join) and o.fork not in started:
            problem = f"joins fork %{o.fork}, which no earlier operation of its block starts"
        if problem is None and isinstance(o, (Branch, Break)) and i != len(block) - 1:
            problem = "must be the last operation of its block (the rest of the segment lives inside it)"
        if problem:
            raise PlanError(f"{where}: {problem}")
        if isinstance(o, Fork):
            started.add(o.node)
            for k, b in enumerate(o.branches):
                _validate_block(b, f"{path}[{i}].branches[{k}]", set())
        elif isinstance(o, Branch):
            _validate_block(o.then, f"{path}[{i}].then", set())
            _validate_block(o.otherwise, f"{path}[{i}].otherwise", set())


# ---- lowering ----------------------------------------------------------------------------------------------------
def lower(g: ProgramGraph, target, stats: dict[str, dict], speculation_tokens: int | None = None) -> Plan:
    """The plan of segment `g` on `target` (lmc.compiler.pipeline.Target), from what the passes decided (`stats`,
    the pass manager's records). `speculation_tokens`: the program's num_api_spec_tokens (groups are planned
    only for the OpenAI-compatible kind, and only with it)."""
    decided = {k: v for st in stats.values() for k, v in st.get("plan", {}).items()}
    speculation_tokens = speculation_tokens if target.kind == "openai" else None
    spec = {}
    if speculation_tokens and "api_speculation" in stats:
        # A program with role turns runs on the chat route: one call serves the gens of one assistant turn.
        roles = any(g.node(n).kind == "role_begin" for n in g.g.nodes)
        groups = stats["api_speculation"]["chat_groups" if roles else "completion_groups"]
        spec = {nid: SpecStep(k, i == 0, speculation_tokens) for k, grp in enumerate(groups)
                for i, nid in enumerate(grp)}
    # A select's prompt is prefilled before its choices only on a local engine whose scheduler does not compute a
    # prefix shared by queued requests once: where it does, the choices (one engine call) already share it, and
    # the prefill would only cost every select a round trip of its own.
    caps = target.capabilities
    select_prefill = target.kind == "local" and not (caps is not None and caps.batch_prefix_sharing)
    # Likewise a fork's prefill hint: where queued requests share a prefix's computation, the branches (queued
    # together) compute the parent's uncached text once among themselves; the hint request, not awaited, lands in
    # their batch, where it keeps them from mixing with running decodes (a plain request's prefill is a forward
    # of its own), and a parent tail shorter than in-batch sharing's minimum is computed by it and every branch.
    fork_prefill = not (caps is not None and caps.batch_prefix_sharing)
    ctx = _Lowering(g, target.kind, decided.get("commits", {}), decided.get("fork_batch", False),
                    decided.get("select_tokens", {}), spec, select_prefill, fork_prefill)
    roots = [r for r in g.roots() if g.node(r).stream == 0]
    plan = Plan(g.name, target.kind, ctx.block(roots[0] if roots else None), list(g.params),
                None if g.inputs is None else list(g.inputs), decided.get("batch_prefix", False),
                speculation_tokens,
                methods={n: m for n, m in g.methods.items()}, graph=g)
    return plan.validate()


@dataclass
class _Lowering:
    g: ProgramGraph
    kind: str
    commits: dict[int, str]
    fork_batch: bool
    select_tokens: dict[int, list[int]]
    spec: dict[int, SpecStep]
    select_prefill: bool  # a general score prefills its prompt first (see lower)
    fork_prefill: bool  # a fork prefills the parent's text + commit first (see lower)

    def __post_init__(self):
        # a fork branch's stream -> its fork (a join finds its fork through the streams that end in it)
        self.fork_of = {self.g.node(item).stream: nid for nid in self.g.g.nodes if self.g.node(nid).kind == "fork"
                        for item, _ in self.g.successors(nid, "fork")}

    def _next(self, nid: int) -> int | None:
        nxt = self.g.successors(nid, "order")
        return nxt[0][0] if nxt else None

    def block(self, start: int | None) -> list[Op]:
        ops: list[Op] = []
        nid = start
        while nid is not None:
            node, g = self.g.node(nid), self.g
            a, op = node.attrs, g.op_of.get(nid)  # op: the body operation
            if node.kind in _TEXT_KINDS:
                part = _part(node.kind, a)
                if ops and isinstance(ops[-1], Extend):
                    ops[-1].parts.append(part)
                else:
                    ops.append(Extend(nid, [part]))
            elif node.kind == "gen":
                ops.append(Generate(nid, op, None if a.get("anonymous") else a["name"], dict(a["params"]),
                                    self.spec.get(nid)))
            elif node.kind == "select":
                ids = self.select_tokens.get(nid)
                ops.append(Score(nid, op, None if a.get("anonymous") else a["name"], list(a["choices"]),
                                 float(a["temperature"]), a["method"], None if ids is None else list(ids),
                                 prefill=self.select_prefill and ids is None and len(a["choices"]) > 1))
            elif node.kind == "set_var":
                ops.append(SetVar(nid, op, a["name"], a["value"], a.get("expr")))
            elif node.kind == "var_scope":
                ops.append(Scope(nid, op, a["name"], a["edge"]))
            elif node.kind == "fork":
                ops.append(Fork(nid, op, self.commits.get(nid, ""), self.fork_batch,
                                [self.block(self._next(item)) for item, _ in g.successors(nid, "fork")],
                                self.fork_prefill))
            elif node.kind == "join":
                ops.append(Join(nid, op, self._fork_of_join(nid, ops), a["mode"]))
            elif node.kind == "call":
                ops.append(Call(nid, op, a["name"], a["program"],
                                {k: [Part(**p) for p in v] for k, v in a["args"].items() if not isinstance(v, dict)},
                                {k: v["value"] for k, v in a["args"].items() if isinstance(v, dict)}))
            elif node.kind == "branch":
                nxt = dict((e.get("when"), d) for d, e in g.successors(nid, "order"))
                ops.append(Branch(nid, a["var"], a["op"], a["value"], self.block(nxt.get("true")),
                                  self.block(nxt.get("false"))))
                return ops
            elif node.kind == "break":
                ops.append(Break(nid, a["reason"], a["line"], a["resume"], a["interpret"]))
                return ops
            elif node.kind != "fork_item":
                raise PlanError(f"%{nid}: a {node.kind} node cannot be lowered to a plan")
            nid = self._next(nid)
        return ops

    def _fork_of_join(self, join: int, ops: list[Op]) -> int:
        ends = self.g.predecessors(join, "fork")
        if ends:
            return self.fork_of[self.g.node(ends[0]).stream]
        joined = {o.fork for o in ops if isinstance(o, Join)}  # a fork of no branch: the latest unjoined one
        return next(o.node for o in reversed(ops) if isinstance(o, Fork) and o.node not in joined)


def _part(kind: str, a: dict) -> Part:
    """A text-producing node as an extend part."""
    if kind == "text":
        return Part(text=a["value"])
    if kind in ("arg", "var"):
        return Part(**{kind: a["name"]}, index=a.get("index"), transforms=list(a.get("transforms", ())))
    if kind in ("role_begin", "role_end"):
        return Part(role=a["role"], edge=kind[len("role_"):])
    return Part(unordered=[[Part(**p) for p in seg] for seg in a["segments"]])


# ---- the text form -----------------------------------------------------------------------------------------------
def format_plan(plan: Plan) -> str:
    """The plan as readable text (one operation a line, nested blocks indented)."""
    head = [f"plan {plan.program}({', '.join(plan.params)}) for {plan.target}"]
    if plan.inputs is not None:
        head.append(f"after({', '.join(plan.inputs)})")
    if plan.batch_prefix:
        head.append("batch_prefix")
    if plan.speculation_tokens:
        head.append(f"speculation {plan.speculation_tokens} tokens")
    lines = [" ".join(head)]
    _format_block(plan.ops, 1, lines)
    return "\n".join(lines) + "\n"


def _format_parts(parts: list[Part]) -> str:
    out = []
    for p in parts:
        suffix = "".join(f".{t}()" for t in p.transforms)
        if p.text is not None:
            out.append(json.dumps(p.text))
        elif p.arg is not None:
            out.append(f"${p.arg}{suffix}")
        elif p.var is not None:
            out.append(f"{{{p.var}}}{'' if p.index is None else f'[{p.index}]'}{suffix}")
        elif p.role is not None:
            out.append(f"<{'/' if p.edge == 'end' else ''}{p.role}>")
        else:
            out.append(f"unordered({', '.join(_format_parts(s) for s in p.unordered)})")
    return " ".join(out)


def _format_block(block: list[Op], depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for o in block:
        head = f"{pad}%{o.node} {o.KIND}"
        if isinstance(o, Extend):
            lines.append(f"{head} {_format_parts(o.parts)}")
        elif isinstance(o, Generate):
            spec = f" spec group {o.spec.group}{' (first)' if o.spec.first else ''}" if o.spec else ""
            lines.append(f"{head} {o.name or '_'} {json.dumps(o.params, sort_keys=True)}{spec}")
        elif isinstance(o, Score):
            how = f" token_ids {o.token_ids}" if o.token_ids is not None else " prefill" if o.prefill else ""
            lines.append(f"{head} {o.name or '_'} {json.dumps(o.choices)} {o.method}{how}")
        elif isinstance(o, SetVar):
            value = json.dumps(o.value, default=repr) if o.expr is None else ir_expr.format_expr(o.expr)
            lines.append(f"{head} {o.name} = {value}")
        elif isinstance(o, Scope):
            lines.append(f"{head} {o.edge} {o.name}")
        elif isinstance(o, Fork):
            commit = (f" commit {json.dumps(o.commit)}" if o.commit else "") if o.prefill else " no prefill"
            lines.append(f"{head} x{len(o.branches)}{' batch' if o.batch else ''}{commit}")
            for k, b in enumerate(o.branches):
                lines.append(f"{pad}  branch {k}:")
                _format_block(b, depth + 2, lines)
        elif isinstance(o, Join):
            lines.append(f"{head} %{o.fork} {o.mode}")
        elif isinstance(o, Call):
            args = {**{k: _format_parts(v) for k, v in o.text_args.items()}, **o.values}
            lines.append(f"{head} {o.name} {o.program}({', '.join(f'{k}={v}' for k, v in args.items())})")
        elif isinstance(o, Branch):
            subject = f"{{{o.var}}}" if isinstance(o.var, str) else ir_expr.format_expr(o.var)
            value = ir_expr.format_expr(o.value) if ir_expr.is_expr(o.value) else json.dumps(o.value, default=repr)
            lines.append(f"{head} {subject} {o.test} {value}")
            lines.append(f"{pad}  then:")
            _format_block(o.then, depth + 2, lines)
            lines.append(f"{pad}  else:")
            _format_block(o.otherwise, depth + 2, lines)
        else:
            lines.append(f"{head} {json.dumps(o.reason)} at {o.line or '?'} resume {o.resume}"
                         f"{' interpret' if o.interpret else ''}")
