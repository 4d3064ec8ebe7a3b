"""The interpreter as the fallback for what a trace cannot resume: run the rest of a program body on an
instance's stream after its compiled segments.

The body runs again from its start on a `ResumedState`: the operations the segments already executed are
counted and skipped (their outputs bound to the executed values, as in a resumed trace), then the state is the
interpreter's own ProgramState on the same stream.
"""
from __future__ import annotations

from ..frontend.primitives import ExprList, Gen, Select, _as_expr
from ..frontend.program import _caller
from ..frontend.state import ProgramState, ProgramStateGroup, Stream
from .trace import Bindings, Host, Known, Resume, _gathered, _tracing


class _Replay:
    """Counts body operations (in the order the tracer counts them); the first `resume.ops` are replayed."""

    def __init__(self, resume: Resume):
        self.resume, self.op, self.call_count, self.gen_count = resume, 0, 0, 0

    def live(self) -> bool:
        return self.op >= self.resume.ops

    def produced(self, bindings: Bindings, name: str) -> None:
        value, meta = self.resume.history.get(self.op, {}).get(name, (None, None))
        bindings.names[name] = Known(value, meta, self.op)

    def nested_run(self, program) -> None:
        """A nested run_batch or streamed run: replayed ones already ran, live ones run (as interpreted)."""

    def call(self, program, args, kwargs, sampling, stream):
        """A nested program call: replayed from its executed outputs, or run for real once live."""
        name = f"{program.__name__}#{self.call_count}"
        self.call_count += 1
        if self.live():
            return None
        self.op += 1
        return _ReplayedCall({k[len(name) + 1:]: v for k, (v, _) in self.resume.history.get(self.op, {}).items()
                              if k.startswith(name + ".")})


class _ReplayedCall:
    def __init__(self, values: dict):
        self._values = values

    def __getitem__(self, var: str):
        return self._values[var]

    get_var = __getitem__

    def variables(self) -> dict:
        return dict(self._values)


class ResumedState(ProgramState):
    """A ProgramState that first replays the operations executed before the resume point."""

    def __init__(self, stream: Stream | None, replay: _Replay, bindings: Bindings):
        super().__init__(stream)
        self._r, self._b = replay, bindings

    def __iadd__(self, expr):
        items = _as_expr(expr)
        for e in items.flatten() if isinstance(items, ExprList) else [items]:
            if self._r.live():
                self._r.op += 1
                self._s.submit(e)
                continue
            self._r.op += 1
            if isinstance(e, (Gen, Select)):
                name = e.name if e.name is not None else f"{'gen' if isinstance(e, Gen) else 'select'}_" \
                                                         f"{self._r.gen_count}"
                self._r.gen_count += 1
                self._r.produced(self._b, name)
        return self

    def _put(self, expr) -> None:
        self.__iadd__(expr)

    def __getitem__(self, name: str):
        if self._r.live():
            return super().__getitem__(name)
        b = self._b.names.get(name)
        if b is None:
            raise KeyError(f"variable {name!r} is not defined; defined variables: {sorted(self._b.names)}")
        return b.value

    get_var = __getitem__

    def __setitem__(self, name: str, value) -> None:
        live = self._r.live()
        self._r.op += 1
        if live:
            super().__setitem__(name, value)
        self._b.names[name] = Host(value)

    set_var = __setitem__

    def __contains__(self, name: str) -> bool:
        return super().__contains__(name) if self._r.live() else name in self._b.names

    def get_meta_info(self, name: str):
        if self._r.live():
            return super().get_meta_info(name)
        b = self._b.names.get(name)
        return b.meta if isinstance(b, Known) else None

    def var_scope(self, name: str):
        if self._r.live():
            return super().var_scope(name)
        return _ReplayedScope(self, name)

    def fork(self, size: int = 1, position_ids_offset=None):
        live = self._r.live()
        self._r.op += 1
        if live:
            return super().fork(size, position_ids_offset)
        return _ReplayedGroup([ResumedState(None, self._r, Bindings(self._b)) for _ in range(int(size))], self)


class _ReplayedScope:
    def __init__(self, state: ResumedState, name: str):
        self.state, self.name = state, name

    def __enter__(self):
        self.state._r.op += 1
        return self.state

    def __exit__(self, *exc):
        self.state._r.op += 1
        self.state._r.produced(self.state._b, self.name)
        return False


class _ReplayedGroup(ProgramStateGroup):
    def join(self, mode: str = "gather_variable") -> None:
        r = self.parent._r
        r.op += 1
        if mode == "gather_variable":
            for name in _gathered(self.parent._b, [st._b for st in self.states]):
                r.produced(self.parent._b, name)


def interpret_rest(program, stream: Stream, resume: Resume, arguments: dict) -> ProgramState:
    """Run the body on `stream` from operation `resume.ops` on (in this thread; waits for the stream)."""
    replay = _Replay(resume)
    state = ResumedState(stream, replay, Bindings())
    tokens = _tracing.set(replay), _caller.set((stream.backend, stream.defaults))
    try:
        state.ret_value = program.func(state, **arguments)
    except Exception as e:
        stream.error = stream.error or e
    finally:
        _caller.reset(tokens[1])
        _tracing.reset(tokens[0])
    stream.sync()
    return state
