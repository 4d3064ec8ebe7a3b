"""Tracer: run a program body with symbolic arguments and record a ProgramGraph.

Arguments and generated values are `Symbol`s: strings holding a sentinel, so f-strings, `+`, `.format` and
`str()` over them trace into text/arg/var nodes. Control flow that reads a generated value (`if s["x"] == "yes"`,
`"yes" in s["x"].lower()`) is explored both ways: the body is re-run once per outcome combination (at most
MAX_PATHS paths) and the paths are merged under `branch` nodes. What cannot be bounded or modelled (a number
parsed from a generated value, too many paths, a decision while a fork is open, a generated value used as a list)
becomes a `dynamic` node: the program then runs in the interpreter, and the report says what stayed static.
Errors raised by the program itself are reported at the user's line.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
import traceback
from dataclasses import dataclass, field

from ..ir import ProgramGraph
from .primitives import ExprList, Gen, Image, RoleBegin, RoleEnd, Select, Text, Unordered, _as_expr
from .state import ProgramStateGroup, RoleMethods

MAX_PATHS = 16
_SENTINEL = re.compile("\x00(arg|var):([^\x00]*)\x00")
_tracing: contextvars.ContextVar = contextvars.ContextVar("lmc_tracing", default=None)
_STR_TRANSFORMS = ("strip", "lower", "upper", "lstrip", "rstrip", "casefold", "title")


class TraceError(Exception):
    """The program raised while being traced; the message points at the user's line."""


class _Dynamic(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Symbol(str):
    """A string standing for an argument or a generated value. Comparisons on generated values are decisions."""

    def __new__(cls, kind: str, name: str, transforms: tuple[str, ...] = ()):
        obj = super().__new__(cls, f"\x00{kind}:{name}\x00")
        obj.kind, obj.name, obj.transforms = kind, name, transforms
        return obj

    def _decide(self, op: str, value) -> bool:
        if self.kind != "var":
            raise _Dynamic(f"control flow on argument {self.name!r}")
        ctx = _tracing.get()
        return ctx.decide(self, op, value)

    def __eq__(self, other):
        if self.kind == "var" and isinstance(other, str) and not isinstance(other, Symbol):
            return self._decide("==", other)
        if self.kind == "arg":
            raise _Dynamic(f"control flow on argument {self.name!r}")
        raise _Dynamic(f"comparison of {self.name!r} with {type(other).__name__}")

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__

    def __contains__(self, item):
        if isinstance(item, str) and not isinstance(item, Symbol):
            return self._decide("contains", item)
        raise _Dynamic(f"membership test on {self.name!r}")

    def startswith(self, prefix, *a):
        return self._decide("startswith", prefix)

    def endswith(self, suffix, *a):
        return self._decide("endswith", suffix)

    def __bool__(self):
        return self._decide("nonempty", None)

    def __len__(self):
        raise _Dynamic(f"len() of {self.name!r}")

    def __iter__(self):
        raise _Dynamic(f"{self.name!r} used as a sequence")

    def __getitem__(self, key):
        raise _Dynamic(f"{self.name!r} indexed or sliced")

    def __int__(self):
        raise _Dynamic(f"int() of {self.name!r}")

    def __float__(self):
        raise _Dynamic(f"float() of {self.name!r}")

    def split(self, *a, **k):
        raise _Dynamic(f"{self.name!r}.split()")

    def __add__(self, other):
        if isinstance(other, str):
            return str.__add__(self, other)
        if isinstance(other, (int, float)):
            raise _Dynamic(f"{self.name!r} used as a number")
        return NotImplemented  # an lmc expression: `arg + gen(...)` builds an expression list

    def __radd__(self, other):
        if isinstance(other, str):
            return other + str(self)
        if isinstance(other, (int, float)):
            raise _Dynamic(f"{self.name!r} used as a number")
        return NotImplemented

    def __lt__(self, other):
        raise _Dynamic(f"ordering comparison on {self.name!r}")

    __le__ = __gt__ = __ge__ = __lt__


def _transform(name):
    def method(self, *a, **k):
        if a or k:
            raise _Dynamic(f"{self.name!r}.{name}() with arguments")
        return Symbol(self.kind, self.name, self.transforms + (name,))

    return method


for _t in _STR_TRANSFORMS:
    setattr(Symbol, _t, _transform(_t))


@dataclass
class _Path:
    plan: list[bool]
    parent_ids: list[int] = field(default_factory=list)  # merged-graph ids of the parent path's emissions
    cut: int = 0  # emissions before this index are shared with the parent path


class _Tracer:
    """Builds one merged graph over several runs of the body (one per decision path)."""

    def __init__(self, graph: ProgramGraph):
        self.g = graph
        self.next_stream = 1
        self.paths_done = 0

    def run(self, program, path: _Path, concrete: dict):
        self.path, self.ids, self.decisions = path, [], []
        self.cursor = {0: None}
        self.when: dict[int, str] = {}
        self.producers: dict[str, int] = {}
        self.open_forks = 0
        self.gen_count = self.call_count = 0
        self.current_stream = 0  # the stream the body last wrote to: where a nested call is placed
        state = TraceState(self, 0)
        token = _tracing.set(self)
        try:
            program.func(state, **program_arguments(program, concrete))
        except _Dynamic as d:
            self.emit("dynamic", 0, reason=d.reason, line=_user_line(program))
        except Exception as e:
            raise TraceError(_user_error(program, e)) from e
        finally:
            _tracing.reset(token)
        return self.ids, self.decisions

    # ---- emission ------------------------------------------------------------------------------------------
    def emit(self, kind: str, stream: int, data_from: str | None = None, **attrs) -> int:
        self.current_stream = stream
        e = len(self.ids)
        if e < self.path.cut:  # shared with the parent path: already in the graph
            nid = self.path.parent_ids[e]
        else:
            nid = self.g.add(kind, stream, **attrs)
            prev = self.cursor.get(stream)
            if prev is not None:
                self.g.connect(prev, nid, "order", self.when.pop(stream, None))
            if data_from is not None and data_from in self.producers:
                self.g.connect(self.producers[data_from], nid, "data")
        self.ids.append(nid)
        self.cursor[stream] = nid
        return nid

    def decide(self, sym: Symbol, op: str, value) -> bool:
        if self.open_forks:
            raise _Dynamic(f"a decision on {sym.name!r} inside a fork")
        i = len(self.decisions)
        outcome = self.path.plan[i] if i < len(self.path.plan) else False
        op_name = "|".join(sym.transforms + (op,))
        if sym.name not in self.producers:
            raise _Dynamic(f"a decision on {sym.name!r}, which this path never generated")
        self.emit("branch", 0, data_from=sym.name, var=sym.name, op=op_name, value=value)
        self.decisions.append((outcome, len(self.ids)))
        self.when[0] = "true" if outcome else "false"
        return outcome

    # ---- text with sentinels -------------------------------------------------------------------------------
    def emit_text(self, stream: int, text: str) -> None:
        text, pos = str.__str__(text), 0  # a plain str: Symbol's own methods are for the user's code
        for m in _SENTINEL.finditer(text):
            if m.start() > pos:
                self.emit("text", stream, value=text[pos:m.start()])
            kind, name = m.group(1), m.group(2)
            if kind == "arg":
                self.emit("arg", stream, name=name)
            else:
                self.emit("var", stream, data_from=name, name=name)
            pos = m.end()
        if pos < len(text):
            self.emit("text", stream, value=text[pos:])


def _parts(text: str, allow_vars: bool = False) -> list[dict]:
    """A string as text / argument (/ variable) parts. Order-free segments take no generated values: their
    canonical order is decided before any generation."""
    text, parts, pos = str.__str__(text), [], 0
    for m in _SENTINEL.finditer(text):
        if m.group(1) == "var" and not allow_vars:
            raise _Dynamic("a generated value inside unordered()")
        if m.start() > pos:
            parts.append({"text": text[pos:m.start()]})
        parts.append({m.group(1): m.group(2)})
        pos = m.end()
    if pos < len(text):
        parts.append({"text": text[pos:]})
    return parts


class TraceState(RoleMethods):
    """The `s` a traced body writes to: records nodes instead of running them."""

    def __init__(self, tracer: _Tracer, stream: int):
        self._t, self._stream = tracer, stream
        self._vars: dict[str, object] = {}

    def __iadd__(self, expr):
        t = self._t
        items = _as_expr(expr)
        for e in items.flatten() if isinstance(items, ExprList) else [items]:
            if isinstance(e, Text):
                t.emit_text(self._stream, e.value)
            elif isinstance(e, Gen):
                name = e.name if e.name is not None else f"gen_{t.gen_count}"
                t.gen_count += 1
                params = {k: v for k, v in vars(e.params).items() if v is not None}
                if "dtype" in params:
                    params["dtype"] = params["dtype"].__name__
                t.producers[name] = t.emit("gen", self._stream, name=name, params=params)
            elif isinstance(e, Select):
                name = e.name if e.name is not None else f"select_{t.gen_count}"
                t.gen_count += 1
                method = type(e.choices_method).__name__ if e.choices_method else "TokenLengthNormalized"
                t.producers[name] = t.emit("select", self._stream, name=name, choices=e.choices, method=method,
                                           temperature=e.temperature)
            elif isinstance(e, RoleBegin):
                t.emit("role_begin", self._stream, role=e.role)
            elif isinstance(e, RoleEnd):
                t.emit("role_end", self._stream, role=e.role)
            elif isinstance(e, Unordered):
                t.emit("unordered", self._stream, segments=[_parts(x) for x in e.segments], canonical=False)
            elif isinstance(e, Image):
                raise _Dynamic("image() (its bytes are not part of the graph)")
            else:
                raise _Dynamic(f"{type(e).__name__} expression")
        return self

    def __getitem__(self, name: str):
        if name in self._vars:
            return self._vars[name]
        if name not in self._t.producers:
            raise KeyError(f"variable {name!r} is not defined; defined variables: {sorted(self._t.producers)}")
        return Symbol("var", name)

    get_var = __getitem__

    def __setitem__(self, name, value):
        if isinstance(value, Symbol) or not isinstance(value, (str, int, float, bool, type(None))):
            raise _Dynamic(f"s[{name!r}] set from host code")
        self._vars[name] = value

    set_var = __setitem__

    def __contains__(self, name):
        return name in self._vars or name in self._t.producers

    def text(self):
        raise _Dynamic("text() read inside the program")

    def messages(self):
        raise _Dynamic("messages() read inside the program")

    def get_meta_info(self, name):
        raise _Dynamic("meta info read inside the program")

    def sync(self):
        pass

    def _put(self, expr) -> None:
        self.__iadd__(expr)

    def var_scope(self, name):
        t = self._t

        def end():
            t.producers[name] = t.emit("var_scope", self._stream, name=name, edge="end")

        return _around(lambda: t.emit("var_scope", self._stream, name=name, edge="begin"), end)

    def fork(self, size: int = 1, position_ids_offset=None) -> "TraceGroup":
        t = self._t
        fork = t.emit("fork", self._stream, size=size)
        states = []
        for i in range(size):
            stream = t.next_stream
            t.next_stream += 1
            st = TraceState(t, stream)
            nid = t.emit("fork_item", stream, index=i)
            if len(t.ids) > t.path.cut:
                t.g.connect(fork, nid, "fork")
            states.append(st)
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
        t = self.parent._t
        ends = [t.cursor[st._stream] for st in self.states]
        nid = t.emit("join", self.parent._stream, mode=mode)
        if len(t.ids) > t.path.cut:
            for end in ends:
                t.g.connect(end, nid, "fork")
        t.open_forks -= 1
        if mode == "gather_variable":
            branches = {st._stream for st in self.states}
            for name, producer in list(t.producers.items()):
                if t.g.node(producer).stream in branches:
                    t.producers[name] = nid  # after the join the gathered list is read from the join


def nested_call_while_tracing(program) -> None:
    """A nested run that is not a plain call (run_batch, a stream) while tracing: a dynamic region."""
    if _tracing.get() is not None:
        raise _Dynamic(f"nested program run {program.__name__}() (only plain calls become call nodes)")


def traced_call(program, args: tuple, kwargs: dict, sampling: dict, stream: bool):
    """A program called from a body being traced becomes a `call` node (it is not run): returns a CallResult
    whose variables trace as reads of the call's outputs. None when no trace is running."""
    t = _tracing.get()
    if t is None:
        return None
    if stream or any(v is not None for v in sampling.values()):
        raise _Dynamic(f"nested program call {program.__name__}() with streaming or its own sampling options")
    name = f"{program.__name__}#{t.call_count}"
    t.call_count += 1
    encoded, reads = {}, []
    for k, v in program._arguments(args, kwargs).items():
        if isinstance(v, str):
            encoded[k] = _parts(v, allow_vars=True)
            reads += [p["var"] for p in encoded[k] if "var" in p]
        elif isinstance(v, (int, float, bool, type(None))):
            encoded[k] = {"value": v}
        else:
            raise _Dynamic(f"nested program call {program.__name__}() with a {type(v).__name__} argument")
    nid = t.emit("call", t.current_stream, name=name, program=program.__name__, args=encoded)
    for var in reads:
        if var in t.producers:
            t.g.connect(t.producers[var], nid, "data")
    t.g.callees[name] = program
    return CallResult(t, name, nid)


class CallResult:
    """What a nested program call returns while tracing: `r["x"]` reads the callee's variable x."""

    def __init__(self, tracer: _Tracer, name: str, nid: int):
        self._t, self._name, self._nid = tracer, name, nid

    def __getitem__(self, var: str) -> Symbol:
        full = f"{self._name}.{var}"
        self._t.producers[full] = self._nid
        return Symbol("var", full)

    get_var = __getitem__

    def text(self):
        raise _Dynamic(f"text() of the nested call {self._name}")

    def variables(self):
        raise _Dynamic(f"variables() of the nested call {self._name}")


@contextlib.contextmanager
def _around(begin, end):
    begin()
    yield
    end()


def program_arguments(program, concrete: dict | None = None) -> dict:
    """Symbols for text arguments; concrete values for the rest (bound, given, or a non-text default), on
    which the graph is specialised."""
    return {**{n: Symbol("arg", n) for n in program.arg_names}, **structural_defaults(program),
            **program.bind_arguments, **(concrete or {})}


def structural_defaults(program) -> dict:
    sig = inspect.signature(program.func)
    return {n: p.default for n, p in sig.parameters.items()
            if n in program.arg_names and p.default is not inspect.Parameter.empty and not isinstance(p.default, str)}


def trace(program, **concrete) -> ProgramGraph:
    """Trace `program` into a ProgramGraph (never fails on a valid program: unmodelled parts become `dynamic`).
    `concrete` arguments are baked in (non-text arguments: loop counts, lists); the others stay symbolic."""
    fixed = {**structural_defaults(program), **program.bind_arguments, **concrete}
    g = ProgramGraph(program.__name__, tuple(n for n in program.arg_names if n not in fixed))
    tracer = _Tracer(g)
    queue = [_Path([])]
    while queue:
        path = queue.pop(0)
        ids, decisions = tracer.run(program, path, concrete)
        tracer.paths_done += 1
        for i in range(len(path.plan), len(decisions)):
            plan = [d[0] for d in decisions[:i]] + [True]
            if tracer.paths_done + len(queue) >= MAX_PATHS:
                _mark_unbounded(g, ids[decisions[i][1] - 1])
                break
            queue.append(_Path(plan, ids, decisions[i][1]))
    return g


def _mark_unbounded(g: ProgramGraph, branch: int) -> None:
    """Too many paths: the unexplored outcome of this branch runs as a dynamic region."""
    nid = g.add("dynamic", 0, reason=f"more than {MAX_PATHS} paths", line="")
    g.connect(branch, nid, "order", "true")


def _user_line(program) -> str:
    """`file.py:line` of the program's own code where tracing stopped (file name only: stable across checkouts)."""
    import os
    import sys

    frames = traceback.extract_tb(sys.exc_info()[2])
    for frame in reversed(frames):
        if frame.filename == program.func.__code__.co_filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return ""


def _user_error(program, exc: Exception) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == program.func.__code__.co_filename]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else program.__name__
    return f"{where}\n{type(exc).__name__}: {exc}"
