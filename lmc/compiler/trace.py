"""Tracer: run a program body with symbolic values and record a ProgramGraph segment.

Arguments and generated values are `Symbol`s: strings holding a sentinel, so f-strings, `+`, `.format`, `str()`
and argument-free str transforms (`.strip()`, `.lower()`, ...) over them trace into text/arg/var nodes. Meta info
read in the segment that generated it is `Derived`: items, arithmetic and round() over it trace into expressions
(lmc.ir.expr), which a variable can be set to (`s["margin"] = round(lps[0] - lps[1], 3)`). After a join, a
gathered variable reads as a list with one item per branch (`s["thought"][i]`, `s.get_meta_info("ok")[i]`).
Control flow that compares a generated or derived value (`if s["x"] == "yes"`, `"yes" in s["x"].lower()`,
`max(range(3), key=lambda i: scores[i])`) is explored both ways: the body is re-run once per outcome combination
(at most MAX_PATHS paths) and the paths are merged under `branch` nodes.

Whatever needs a concrete value the trace does not have (int() of generated text, a dict lookup, a str method
with arguments, a loop over a generated list, formatting a derived number, a tool called on a generated value, an
error raised by the program) is a graph break: the segment ends in a `break` node that records where the body
stands (`resume`: the number of body operations before it). At run time the executor runs the segment, then the body is traced
again from its start with the instance's values, *replaying* the executed operations without emitting them: a
value generated before the break is now `known`, and host code that reads it concretely gets the real value
(each such read is recorded as a guard); tracing resumes at the break and records the next segment. Segments are
cached behind their guards (lmc.compiler.compiled). What cannot be resumed by tracing (a break inside an open
fork, text() reads, images, nested batch runs) becomes an interpreting break: from there on the interpreter
runs the rest of the body (lmc.compiler.interpret), replaying the same way.

The replay relies on what the tracer has always relied on: a program body is a deterministic function of its
arguments and of the values it reads from `s`. Host code before a break runs again on each resume.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

from ..frontend.primitives import ExprList, Gen, Image, RoleBegin, RoleEnd, Select, Text, Unordered, _as_expr
from ..frontend.program import tracing
from ..frontend.state import ProgramStateGroup, RoleMethods
from ..ir import ProgramGraph
from ..ir.expr import reads as expr_reads
from .symbols import UNKNOWN, Derived, GraphBreak, Symbol

MAX_PATHS = 16
_SENTINEL = re.compile("\x00(arg|var):([^\x00\x01|]*)(?:\x01(\\d+))?((?:\\|[a-z]+)*)\x00")
_tracing = tracing  # the frontend's hook: nested program calls ask the active tracer what they become
# ---- replay state ------------------------------------------------------------------------------------------------
@dataclass
class Resume:
    """Where a resumed trace (or interpretation) starts: the body operations already executed, what they produced
    (op index -> variable -> (value, meta), recorded by the executor), and the instance's arguments."""
    ops: int
    history: dict[int, dict[str, tuple[Any, Any]]]
    args: dict[str, Any]


@dataclass
class Known:
    """A variable produced by an executed operation (`op`)."""
    value: Any
    meta: Any
    op: int


@dataclass
class Host:
    """A variable the body set itself (`s["x"] = ...`)."""
    value: Any


class Bindings:
    """What each variable name of one stream refers to at the body's current operation, in body order: a node of
    the segment being traced (an int), a Known value, or a Host value."""

    def __init__(self, parent: "Bindings | None" = None):
        self.names: dict[str, Any] = dict(parent.names) if parent else {}


@dataclass
class _Path:
    plan: list[bool]
    parent_ids: list[int] = field(default_factory=list)  # merged-graph ids of the parent path's emissions
    cut: int = 0  # emissions before this index are shared with the parent path


class _Tracer:
    """Builds one merged segment graph over several runs of the body (one per decision path)."""

    def __init__(self, graph: ProgramGraph, resume: Resume | None):
        self.g = graph
        self.resume = resume
        self.next_stream = 1
        self.paths_done = 0
        self.guards: dict[tuple, Any] = {}

    @property
    def skip(self) -> int:
        return self.resume.ops if self.resume else 0

    def run(self, program, path: _Path, concrete: dict):
        self.path, self.ids, self.decisions = path, [], []
        self.cursor = {0: None}
        self.when: dict[int, str] = {}
        self.producers: dict[str, int] = {}
        self.gathered: dict[str, tuple[int, int]] = {}  # a gathered variable -> (its join node, its branches)
        self.open_forks = 0
        self.fork_mark: tuple | None = None
        self.op = 0  # body operations so far (the replay skips those before self.skip)
        self.gen_count = self.call_count = 0
        self.current_stream = 0  # the stream the body last wrote to: where a nested call is placed
        state = TraceState(self, 0, Bindings())
        token = _tracing.set(self)
        try:
            program.func(state, **program_arguments(program, concrete, self.resume))
            if self.op < self.skip:
                raise GraphBreak("the body took fewer operations than were executed (it is not deterministic)", True)
        except GraphBreak as b:
            self._break(b.reason, b.interpret, _user_line(program))
        except Exception as e:
            # The program's own error, or host code given a traced value where it needs a real str (re, ast,
            # json): resume with the values there; if it raises again right at the resume point, the
            # interpreter runs the rest (and raises it, if it is the program's error).
            self._break(f"{type(e).__name__}: {e}", self.op == self.skip, _user_line(program, e))
        finally:
            _tracing.reset(token)
        return self.ids, self.decisions

    def _break(self, reason: str, interpret: bool, line: str) -> None:
        resume = self.op
        if self.open_forks:  # no resuming inside a fork: drop the open fork, interpret from it on
            mark, resume, cursor, when = self.fork_mark
            self.g.g.remove_nodes_from(self.ids[mark:])
            del self.ids[mark:]
            self.cursor, self.when, self.open_forks = cursor, when, 0
            interpret, reason = True, f"{reason} (inside a fork)"
        if resume < self.skip:
            resume, interpret = self.skip, True
        self.emit("break", 0, reason=reason, line=line, resume=resume, interpret=interpret)

    # ---- operations ----------------------------------------------------------------------------------------
    def emitting(self) -> bool:
        """Whether the next body operation is to be emitted (it did not run before the resume). Whatever may
        break is evaluated before the operation is counted (`count`), so a break resumes at that operation."""
        return self.op >= self.skip

    def count(self) -> None:
        self.op += 1

    def executed(self, op: int) -> dict[str, tuple[Any, Any]]:
        return self.resume.history.get(op, {})

    def guard_arg(self, name: str, value) -> None:
        self.guards[("arg", name)] = value

    def guard_var(self, name: str, known: Known, meta: bool = False) -> None:
        """The body read an executed value: the segment holds for instances whose value is the same."""
        self.guards[("meta" if meta else "var", known.op, name)] = known.meta if meta else known.value

    # ---- emission ------------------------------------------------------------------------------------------
    def emit(self, kind: str, stream: int, data_from: str | None = None, **attrs) -> int:
        self.current_stream = stream
        e = len(self.ids)
        if e < self.path.cut:  # shared with the parent path: already in the graph
            nid = self.path.parent_ids[e]
        else:
            nid = self.g.add(kind, stream, **attrs)
            self.g.op_of[nid] = self.op
            prev = self.cursor.get(stream)
            if prev is not None:
                self.g.connect(prev, nid, "order", self.when.pop(stream, None))
            if data_from is not None and data_from in self.producers:
                self.g.connect(self.producers[data_from], nid, "data")
        self.ids.append(nid)
        self.cursor[stream] = nid
        return nid

    def decide(self, sym: Symbol, op: str, value) -> bool:
        """A test of a generated value (with its transforms) against a constant."""
        subject = sym.name if sym.item is None else ["item", ["var", sym.name], sym.item]
        return self._branch(subject, "|".join(sym.transforms + (op,)), value, [sym.name])

    def decide_expr(self, subject: list, op: str, value) -> bool:
        """A test of a derived value against a constant or another derived value (an expression)."""
        return self._branch(subject, op, value, expr_reads(subject) + expr_reads(value))

    def _branch(self, subject, op: str, value, reads: list[str]) -> bool:
        """Emit the decision's branch node; the outcome is this path's."""
        missing = [n for n in reads if n not in self.producers]
        if missing:
            raise GraphBreak(f"a decision on {missing[0]!r}, which this path never generated")
        if self.open_forks:
            raise GraphBreak(f"a decision on {reads[0]!r}")
        i = len(self.decisions)
        outcome = self.path.plan[i] if i < len(self.path.plan) else False
        self._reading(self.emit("branch", 0, var=subject, op=op, value=value), reads)
        self.decisions.append((outcome, len(self.ids), self.op))
        self.when[0] = "true" if outcome else "false"
        return outcome

    def _reading(self, nid: int, names: list[str]) -> None:
        """`data` edges into a node from the producers of the variables it reads."""
        if len(self.ids) > self.path.cut:  # (a node shared with the parent path has its edges)
            for n in dict.fromkeys(names):
                if n in self.producers:
                    self.g.connect(self.producers[n], nid, "data")

    # ---- text with sentinels -------------------------------------------------------------------------------
    def emit_text(self, stream: int, text: str) -> None:
        pos = 0
        for m in _SENTINEL.finditer(text):
            if m.start() > pos:
                self.emit("text", stream, value=text[pos:m.start()])
            kind, name, transforms = m.group(1), m.group(2), _split_transforms(m.group(4))
            extra = {"transforms": list(transforms)} if transforms else {}
            if m.group(3) is not None:
                extra["index"] = int(m.group(3))
            if kind == "arg":
                self.emit("arg", stream, name=name, **extra)
            else:
                self.emit("var", stream, data_from=name, name=name, **extra)
            pos = m.end()
        if pos < len(text):
            self.emit("text", stream, value=text[pos:])


def _split_transforms(group: str) -> tuple[str, ...]:
    return tuple(t for t in group.split("|") if t)


def _parts(text: str, allow_vars: bool = False) -> list[dict]:
    """A string as text / argument (/ variable) parts. Order-free segments take no generated values: their
    canonical order is decided before any generation."""
    text, parts, pos = str(text), [], 0
    for m in _SENTINEL.finditer(text):
        if m.group(1) == "var" and not allow_vars:
            raise GraphBreak("a generated value inside unordered()")
        if m.group(3) is not None or m.group(4):
            raise GraphBreak(f"an item or a transformed value of {m.group(2)!r} in a call argument or unordered()")
        if m.start() > pos:
            parts.append({"text": text[pos:m.start()]})
        parts.append({m.group(1): m.group(2)})
        pos = m.end()
    if pos < len(text):
        parts.append({"text": text[pos:]})
    return parts


class TraceState(RoleMethods):
    """The `s` a traced body writes to: records nodes instead of running them (or, replaying, counts the
    operations that already ran and binds their outputs to the executed values)."""

    _joined = False  # a fork branch whose join has been traced

    def __init__(self, tracer: _Tracer, stream: int, bindings: Bindings):
        self._t, self._stream, self._b = tracer, stream, bindings

    def _produced(self, name: str, nid: int | None) -> None:
        """`name` was produced by this operation: a node (emitting) or the executed value (replaying)."""
        t = self._t
        if nid is not None:
            self._b.names[name] = nid
            t.producers[name] = nid
        else:
            value, meta = t.executed(t.op).get(name, (None, None))
            self._b.names[name] = Known(value, meta, t.op)

    def __iadd__(self, expr):
        t = self._t
        items = _as_expr(expr)
        for e in items.flatten() if isinstance(items, ExprList) else [items]:
            emitting = t.emitting()
            if isinstance(e, Image):
                raise GraphBreak("image() (its bytes are not part of the graph)", interpret=True)
            if not isinstance(e, (Text, Gen, Select, RoleBegin, RoleEnd, Unordered)):
                raise GraphBreak(f"{type(e).__name__} expression", interpret=True)
            segments = [_parts(x) for x in e.segments] if emitting and isinstance(e, Unordered) else None
            t.count()
            if isinstance(e, Text):
                if emitting:
                    t.emit_text(self._stream, e.value)
            elif isinstance(e, Gen):
                name = e.name if e.name is not None else f"gen_{t.gen_count}"
                t.gen_count += 1
                params = {k: v for k, v in vars(e.params).items() if v is not None}
                if "dtype" in params:
                    params["dtype"] = params["dtype"].__name__
                anonymous = {"anonymous": True} if e.name is None else {}  # runs without setting a variable
                self._produced(name, t.emit("gen", self._stream, name=name, params=params, **anonymous)
                               if emitting else None)
            elif isinstance(e, Select):
                name = e.name if e.name is not None else f"select_{t.gen_count}"
                t.gen_count += 1
                nid = None
                if emitting:
                    method = type(e.choices_method).__name__ if e.choices_method else "TokenLengthNormalized"
                    nid = t.emit("select", self._stream, name=name, choices=e.choices, method=method,
                                 temperature=e.temperature, **({"anonymous": True} if e.name is None else {}))
                    if e.choices_method is not None:
                        t.g.methods[nid] = e.choices_method
                self._produced(name, nid)
            elif isinstance(e, (RoleBegin, RoleEnd)):
                if emitting:
                    t.emit("role_begin" if isinstance(e, RoleBegin) else "role_end", self._stream, role=e.role)
            elif emitting:
                t.emit("unordered", self._stream, segments=segments)
        return self

    def _lookup(self, name: str):
        b = self._b.names.get(name, UNKNOWN)
        if b is UNKNOWN:
            raise KeyError(f"variable {name!r} is not defined; defined variables: {sorted(self._b.names)}")
        return b

    def __getitem__(self, name: str):
        b = self._lookup(name)
        if isinstance(b, Host):
            return b.value
        if isinstance(b, Known):
            self._t.guard_var(name, b)
            return b.value
        if self._joined:  # a var node reads the current stream's variable, which after the join is the gathered list
            raise GraphBreak(f"branch variable {name!r} read after the join (forks[i][...]) needs its value")
        n = self._branches(name, b)
        return Symbol("var", name) if n is None else _Gathered(name, [Symbol("var", name, item=i) for i in range(n)])

    get_var = __getitem__

    def _branches(self, name: str, binding) -> int | None:
        """How many branches gathered `name`, where its binding is a join's (None: it is no gathered list)."""
        join, n = self._t.gathered.get(name, (None, None))
        return n if binding == join else None

    def __setitem__(self, name, value):
        t = self._t
        emitting = t.emitting()
        expr = None
        if emitting:
            expr = _derived_expr(value)
            if expr is None:
                value = _concretize(value)
        t.count()
        if emitting and expr is not None:  # computed where it runs, from the values it reads
            t._reading(t.emit("set_var", self._stream, name=name, value=None, expr=expr), expr_reads(expr))
        elif emitting:
            t.emit("set_var", self._stream, name=name, value=value)
        self._b.names[name] = Host(value)

    set_var = __setitem__

    def __contains__(self, name):
        return name in self._b.names

    def text(self):
        raise GraphBreak("text() read inside the program", interpret=True)

    def messages(self):
        raise GraphBreak("messages() read inside the program", interpret=True)

    def get_meta_info(self, name):
        b = self._lookup(name)
        if isinstance(b, Known):
            self._t.guard_var(name, b, meta=True)
            return b.meta
        if isinstance(b, Host):
            return None
        if self._joined:
            raise GraphBreak(f"meta info of branch variable {name!r} read after the join")
        n = self._branches(name, b)
        return Derived(["meta", name]) if n is None else [Derived(["item", ["meta", name], i]) for i in range(n)]

    def sync(self):
        pass

    def _put(self, expr) -> None:
        self.__iadd__(expr)

    def var_scope(self, name):
        t = self._t

        def begin():
            emitting = t.emitting()
            t.count()
            if emitting:
                t.emit("var_scope", self._stream, name=name, edge="begin")

        def end():
            emitting = t.emitting()
            t.count()
            self._produced(name, t.emit("var_scope", self._stream, name=name, edge="end") if emitting else None)

        return _around(begin, end)

    def fork(self, size: int = 1, position_ids_offset=None) -> "TraceGroup":
        t = self._t
        size = int(size)  # a generated size reads its value (a break before the fork, resumed with the value)
        emitting = t.emitting()
        if emitting and not t.open_forks:
            t.fork_mark = (len(t.ids), t.op, dict(t.cursor), dict(t.when))
        t.count()
        fork = t.emit("fork", self._stream, size=size) if emitting else None
        states = []
        for i in range(size):
            stream = t.next_stream
            t.next_stream += 1
            st = TraceState(t, stream, Bindings(self._b))
            if emitting:
                nid = t.emit("fork_item", stream, index=i)
                if len(t.ids) > t.path.cut:
                    t.g.connect(fork, nid, "fork")
            states.append(st)
        if emitting:
            t.open_forks += 1
        return TraceGroup(states, self)

    @contextlib.contextmanager
    def copy(self):
        group = self.fork(1)
        yield group[0]
        group.join()


class TraceGroup(ProgramStateGroup):
    """The branches of a traced fork: indexing and `+=` as when running; join records a join node."""

    def join(self, mode: str = "gather_variable"):
        parent = self.parent
        t = parent._t
        emitting = t.emitting()
        t.count()
        for st in self.states:
            st._joined = True
        if not emitting:  # replaying: the gathered values are the executed ones
            if mode == "gather_variable":
                for name in _gathered(parent._b, [st._b for st in self.states]):
                    parent._produced(name, None)
            return
        ends = [t.cursor[st._stream] for st in self.states]
        nid = t.emit("join", parent._stream, mode=mode)
        if len(t.ids) > t.path.cut:
            for end in ends:
                t.g.connect(end, nid, "fork")
        t.open_forks -= 1
        if mode == "gather_variable":
            for name in _gathered(parent._b, [st._b for st in self.states]):
                parent._produced(name, nid)
                t.gathered[name] = (nid, len(self.states))


def _gathered(parent: Bindings, branches: list[Bindings]) -> list[str]:
    """The names a gather_variable join defines: those the branches bound that the parent did not have (as the
    interpreter's join does)."""
    return list(dict.fromkeys(k for b in branches for k in b.names if k not in parent.names))


class _Gathered(list):
    """A gathered variable read after its join: one symbol per branch (`s["thought"][i]`, a loop over them), and
    as a whole, the variable (formatted, it renders the list as the interpreter's f-string does). str() of it reads
    its value (a graph break): what the body does with that str next is not traced."""

    def __init__(self, name: str, items: list[Symbol]):
        super().__init__(items)
        self._whole = Symbol("var", name)

    def __str__(self) -> str:
        return self._whole._concrete("str() of a gathered list")

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return format(self._whole, spec)

    def __lmc_text__(self) -> str:
        return str(self._whole)


def _derived_expr(value):
    """The expression a value the body sets is, where it holds derived values (a list of scores, say); None for a
    value with none (a constant, or symbols, which read their values)."""
    if isinstance(value, Derived):
        return value.expr
    if isinstance(value, (list, tuple)):
        items = [_derived_expr(v) for v in value]
        if any(e is not None for e in items):
            return ["list", *(_constant(v) if e is None else e for e, v in zip(items, value))]
    return None


def _constant(value):
    """A constant inside an expression: a scalar as it is, a list as ["list", ...] (lmc.ir.expr)."""
    value = _concretize(value)
    if isinstance(value, (list, tuple)):
        return ["list", *map(_constant, value)]
    if isinstance(value, dict):
        raise GraphBreak("a dict next to derived values in a variable")
    return value


def _concretize(value):
    """A value the body sets as a variable, with the symbols in it read (a break for an unknown one)."""
    if isinstance(value, Symbol):
        return value._concrete("setting a variable")
    if isinstance(value, (list, tuple)):
        return type(value)(_concretize(v) for v in value)
    if isinstance(value, dict):
        return {_concretize(k): _concretize(v) for k, v in value.items()}
    return value


def _trace_call(t: _Tracer, program, args, kwargs, sampling, stream):
    if stream or any(v is not None for v in sampling.values()):
        raise GraphBreak(f"nested program call {program.__name__}() with streaming or its own sampling options", True)
    name = f"{program.__name__}#{t.call_count}"
    t.call_count += 1
    if not t.emitting():
        t.count()
        return CallResult(t, name, None, t.op)
    encoded, reads = {}, []
    for k, v in program._arguments(args, kwargs).items():
        if isinstance(v, str):
            encoded[k] = _parts(v, allow_vars=True)
            reads += [p["var"] for p in encoded[k] if "var" in p]
        elif isinstance(v, (int, float, bool, type(None))):
            encoded[k] = {"value": v}
        else:
            raise GraphBreak(f"nested program call {program.__name__}() with a {type(v).__name__} argument", True)
    t.count()
    nid = t.emit("call", t.current_stream, name=name, program=program.__name__, args=encoded)
    for var in reads:
        if var in t.producers:
            t.g.connect(t.producers[var], nid, "data")
    t.g.callees[name] = program
    return CallResult(t, name, nid, t.op)


def _nested_run(t: _Tracer, program) -> None:
    """A nested run that is not a plain call (run_batch, a stream) while tracing: the interpreter runs it."""
    raise GraphBreak(f"nested program run {program.__name__}() (only plain calls become call nodes)", interpret=True)


_Tracer.call, _Tracer.nested_run = _trace_call, _nested_run


class CallResult:
    """What a nested program call returns while tracing: `r["x"]` reads the callee's variable x."""

    def __init__(self, tracer: _Tracer, name: str, nid: int | None, op: int):
        self._t, self._name, self._nid, self._op = tracer, name, nid, op

    def __getitem__(self, var: str) -> Symbol:
        full = f"{self._name}.{var}"
        if self._nid is None:  # replaying an executed call
            known = Known(*self._t.executed(self._op).get(full, (None, None)), self._op)
            self._t.guard_var(full, known)
            return known.value
        self._t.producers[full] = self._nid
        return Symbol("var", full)

    get_var = __getitem__

    def text(self):
        raise GraphBreak(f"text() of the nested call {self._name}", interpret=True)

    def variables(self):
        raise GraphBreak(f"variables() of the nested call {self._name}", interpret=True)


@contextlib.contextmanager
def _around(begin, end):
    begin()
    yield
    end()


def program_arguments(program, concrete: dict | None = None, resume: Resume | None = None) -> dict:
    """Symbols for text arguments (known ones when resuming an instance); concrete values for the rest (bound,
    given, or a non-text default), on which the graph is specialised."""
    known = resume.args if resume else {}
    return {**{n: Symbol("arg", n, known=known.get(n, UNKNOWN)) for n in program.arg_names},
            **structural_defaults(program), **program.bind_arguments, **(concrete or {})}


def structural_defaults(program) -> dict:
    sig = inspect.signature(program.func)
    return {n: p.default for n, p in sig.parameters.items()
            if n in program.arg_names and p.default is not inspect.Parameter.empty and not isinstance(p.default, str)}


@dataclass
class Segment:
    """A traced segment and the guards it was traced under ((kind, [op,] name) -> the value read)."""
    graph: ProgramGraph
    guards: dict[tuple, Any]


def trace_segment(program, concrete: dict, resume: Resume | None = None) -> Segment:
    fixed = {**structural_defaults(program), **program.bind_arguments, **concrete}
    g = ProgramGraph(program.__name__, tuple(n for n in program.arg_names if n not in fixed))
    if resume is not None:
        g.inputs = tuple(sorted({n for vs in resume.history.values() for n in vs}))
    tracer = _Tracer(g, resume)
    queue = [_Path([])]
    while queue:
        path = queue.pop(0)
        ids, decisions = tracer.run(program, path, concrete)
        tracer.paths_done += 1
        for i in range(len(path.plan), len(decisions)):
            plan = [d[0] for d in decisions[:i]] + [True]
            if tracer.paths_done + len(queue) >= MAX_PATHS:
                _mark_unbounded(g, ids[decisions[i][1] - 1], decisions[i][2])
                break
            queue.append(_Path(plan, ids, decisions[i][1]))
    return Segment(g, tracer.guards)


def trace(program, **concrete) -> ProgramGraph:
    """Trace `program` into its first segment (never fails on a valid program: what needs concrete values
    becomes a break). `concrete` arguments are baked in (non-text arguments: loop counts, lists); the others stay
    symbolic."""
    return trace_segment(program, concrete).graph


def _mark_unbounded(g: ProgramGraph, branch: int, op: int) -> None:
    """Too many paths: the unexplored outcome of this branch is a break (resumed once the value is known)."""
    nid = g.add("break", 0, reason=f"more than {MAX_PATHS} paths", line="", resume=op, interpret=False)
    g.op_of[nid] = op
    g.connect(branch, nid, "order", "true")


def _user_line(program, exc: BaseException | None = None) -> str:
    """`file.py:line` of the program body where tracing stopped (the body's own line, not a helper's it called;
    file name only: stable across checkouts)."""
    tb = exc.__traceback__ if exc is not None else sys.exc_info()[2]
    code = program.func.__code__
    lines = [lineno for frame, lineno in traceback.walk_tb(tb) if frame.f_code is code]
    return f"{os.path.basename(code.co_filename)}:{lines[-1]}" if lines else ""
