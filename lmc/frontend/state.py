"""Program execution: streams of expressions run in order, many streams at once.

A `Stream` is one token stream (SGLang's StreamExecutor): the program body appends expressions to it from its
own thread and they execute in order as coroutines on one shared frontend event loop, so a thousand forks or
batch programs in flight cost no threads. `ProgramState` (the `s` of a program) is the user-facing handle.

Fixed here, compared with SGLang's frontend:
- `fork` waits for the parent's queue before reading its text, so the shared-prefix commit is never skipped;
- an error in a stream fails what waits on it: later reads raise it, `sync()` returns instead of hanging;
- reading a variable blocks only until that variable is produced, and an unknown name raises a KeyError that
  lists the defined ones.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, Iterator

from ..protocol import capabilities, token_length_normalized
from ..protocol.backend import set_current_stream
from .primitives import (DEFAULT_PARAMS, Expr, ExprList, Gen, GenParams, Image, RoleBegin, RoleEnd, Select, Text,
                         Unordered, _as_expr)

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def frontend_loop() -> asyncio.AbstractEventLoop:
    """The one background event loop every stream runs on (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="lmc-frontend", daemon=True).start()
        return _loop


class VarScopeBegin(Expr):
    def __init__(self, name: str):
        self.name = name


class VarScopeEnd(Expr):
    def __init__(self, name: str):
        self.name = name


class Commit(Expr):
    """Hint: prefill the stream's text now (before a fork), so branches share one cached prefix."""


class ConcatAppend(Expr):
    def __init__(self, children: list["Stream"]):
        self.children = children


class Stream:
    def __init__(self, backend, defaults: GenParams = DEFAULT_PARAMS, stream_tokens: bool = False,
                 num_api_spec_tokens: int | None = None):
        self.backend, self.defaults = backend, defaults
        self.stream_tokens = stream_tokens
        self.num_api_spec_tokens = num_api_spec_tokens
        self.text = ""
        self.messages: list[dict] = []
        self.images: list[Image] = []
        self.vars: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.role: str | None = None
        self.role_begin = 0
        self.fork_start = 0
        self.scopes: dict[str, int] = {}
        self.error: BaseException | None = None
        # Compiled execution only: body operation -> variable -> (value, meta) produced by it, shared by a
        # stream and its forks (what a resumed trace replays, lmc.compiler.trace). None: not recorded.
        self.history: dict[int, dict[str, tuple]] | None = None
        self.hints = None  # the ProgramHints of the LM call the plan executor makes now (lmc.protocol.current_hints)
        self._cond = threading.Condition()
        self._queued = 0  # submitted, not yet executed
        self._pending = Counter()  # variable -> producers queued
        self._version = 0  # bumped on every text change (streaming readers wait on it)
        self._idle_waiters: list[Future] = []
        self._items: deque[Expr] = deque()  # touched on the loop thread only
        self._draining = False
        self._loop = frontend_loop()

    # ---- body-thread side ----------------------------------------------------------------------------------
    def submit(self, expr) -> None:
        items = _as_expr(expr)
        items = items.flatten() if isinstance(items, ExprList) else [items]
        with self._cond:
            for e in items:
                if isinstance(e, (Gen, Select)) and e.name is not None:
                    self._pending[e.name] += 1
            self._queued += len(items)
        self._loop.call_soon_threadsafe(self._enqueue, items)

    def sync(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._queued == 0)

    def when_idle(self) -> Future:
        """A future resolved once everything submitted so far has executed."""
        fut: Future = Future()
        with self._cond:
            if self._queued:
                self._idle_waiters.append(fut)
                return fut
        fut.set_result(self)
        return fut

    def get_var(self, name: str) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: self._pending[name] == 0 or self.error is not None)
            if self.error is not None and (self._pending[name] or name not in self.vars):
                raise self.error  # the stream failed before producing it
            if name not in self.vars:
                raise KeyError(f"variable {name!r} is not defined; defined variables: {sorted(map(str, self.vars))}")
            return self.vars[name]

    def wait_text_change(self, seen: int, timeout: float | None = None) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._version != seen or self._queued == 0, timeout)
            return self._version

    # ---- loop side -----------------------------------------------------------------------------------------
    def _enqueue(self, items: list[Expr]) -> None:
        self._items.extend(items)
        if not self._draining:  # an idle stream holds no task: thousands of finished programs cost nothing
            self._draining = True
            self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        set_current_stream(self)  # this task's backend calls serve this stream
        while self._items:
            e = self._items.popleft()
            try:
                if self.error is None:
                    await self._execute(e)
            except Exception as exc:  # the stream stops executing; readers of its variables get this error
                self.error = exc
            finally:
                with self._cond:
                    if isinstance(e, (Gen, Select)) and e.name is not None:
                        self._pending[e.name] -= 1
                    self._queued -= 1
                    self._cond.notify_all()
                    waiters = self._idle_waiters if self._queued == 0 else []
                    if waiters:
                        self._idle_waiters = []
                for fut in waiters:
                    fut.set_result(self)
        self._draining = False

    async def _execute(self, e: Expr) -> None:
        if isinstance(e, Text):
            self.append(e.value)
        elif isinstance(e, RoleBegin):
            self.begin_role(e.role)
        elif isinstance(e, RoleEnd):
            self.end_role(e.role)
        elif isinstance(e, Gen):
            await self.generate(e.name, e.params)
        elif isinstance(e, Select):
            await self.score(e.name, e.choices, e.temperature, e.choices_method)
        elif isinstance(e, Image):
            if not capabilities(self.backend).images:
                raise ValueError(f"image(): the backend {self.backend!r} serves a text-only model; images need a "
                                 "vision-capable API backend")
            self.images.append(e)
        elif isinstance(e, VarScopeBegin):
            self.scope_begin(e.name)
        elif isinstance(e, VarScopeEnd):
            self.scope_end(e.name)
        elif isinstance(e, Unordered):
            self.append(e.render())
        elif isinstance(e, Commit):
            await self.backend.commit(self.text)
        elif isinstance(e, ConcatAppend):
            self.concat(e.children)
        else:
            raise TypeError(f"unknown expression {e!r}")

    # ---- the primitives (the interpreter's expressions and the compiled plan's operations both run on these;
    # on the loop thread). `op`: the body operation a produced value is recorded under (compiled runs) ----------
    def append(self, text: str) -> None:
        with self._cond:
            self.text += text
            self._version += 1
            self._cond.notify_all()

    def begin_role(self, role: str) -> None:
        tmpl = self.backend.chat_template
        if self.role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.role!r}: roles cannot nest")
        if role != "system" and not self.messages and tmpl.default_system and not self.text:
            self.append(tmpl.default_system)  # what the model's template inserts without a system turn
        self.append(tmpl.prefix[role])
        self.role, self.role_begin = role, len(self.text)

    def end_role(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"role end {role!r} does not match the open role {self.role!r}")
        content = self.text[self.role_begin:].lstrip()
        self.append(self.backend.chat_template.suffix[role])
        self.messages.append({"role": role, "content": content})
        self.role = None

    async def generate(self, name: str | None, params: GenParams, op: int | None = None,
                       speculation=None) -> None:
        """Continue the text with one gen into variable `name` (None: the text only). `speculation`: the
        lmc.protocol.SpecStep a compiled plan gives it, for backends that run planned API speculation."""
        params = self.call_params(params)
        if self.stream_tokens and (params.n or 1) == 1:
            out, meta = "", None
            async for delta, meta in self.backend.generate_stream(self.text, params, self.images):
                out += delta
                self.append(delta)
                if name is not None:
                    self.vars[name] = out
        else:
            planned = speculation is not None and capabilities(self.backend).planned_speculation
            out, meta = await self.backend.generate(self.text, params, self.images,
                                                    **({"speculation": speculation} if planned else {}))
            self.append(out[0] if isinstance(out, list) else out)
        self._set(name, _convert(out, params.dtype, name), meta, op)

    def call_params(self, params: GenParams) -> GenParams:
        """A gen's parameters as its call gets them here: over the program's defaults, and in an assistant turn
        with the template's end-of-turn tokens as stops."""
        params = params.merged_over(self.defaults)
        if self.role == "assistant" and self.backend.chat_template.stop_token_ids:
            params.stop_token_ids = list(params.stop_token_ids or ()) + list(self.backend.chat_template.stop_token_ids)
        return params

    def put_gen(self, name: str | None, params: GenParams, out: str, meta, op: int | None = None) -> None:
        """A gen's output computed elsewhere (an engine chain, lmc.compiler.chain): appended and set, as
        `generate` does with its own. `params`: from call_params."""
        self.append(out)
        self._set(name, _convert(out, params.dtype, name), meta, op)

    async def score(self, name: str | None, choices: list[str], temperature: float, method=None,
                    op: int | None = None, token_ids: list[int] | None = None, prefill: bool = False) -> None:
        """Select one of `choices` into `name`. `token_ids`: each choice's single token after the text (scored in
        one request where the backend can; else as below); `prefill`: prefill the text once before the choices
        extend it (so that they do not each compute its uncached part)."""
        method = method or token_length_normalized
        decision = None
        if token_ids is not None and capabilities(self.backend).token_id_selects:
            decision = await self.backend.select_tokens(self.text, choices, token_ids, method)
        if decision is None:
            if prefill and len(choices) > 1:
                await self.backend.commit(self.text)
            decision = await self.backend.select(self.text, choices, temperature, method)
        self.put_choice(name, decision, op)

    def put_choice(self, name: str | None, decision, op: int | None = None) -> None:
        """A select's ChoicesDecision (made here or by an engine chain): appended and set."""
        self.append(decision.decision)
        self._set(name, decision.decision, decision.meta_info, op)

    def set_var(self, name: str, value, op: int | None = None) -> None:
        self.vars[name] = value
        self.record(op, {name: (value, None)})

    def scope_begin(self, name: str) -> None:
        self.scopes[name] = len(self.text)

    def scope_end(self, name: str, op: int | None = None) -> None:
        self._set(name, self.text[self.scopes.pop(name):], None, op)

    def concat(self, children: list["Stream"]) -> None:
        """concate_and_append: the branches' own text, in order (a failed branch fails this stream)."""
        for child in children:
            if child.error is not None:
                raise child.error
            self.append(child.text[child.fork_start:])

    def gather(self, children: list["Stream"], op: int | None = None) -> None:
        """gather_variable: each variable the branches defined (and this stream did not have) becomes the list
        of their values; a branch's error becomes this stream's."""
        inherited = set(self.vars)
        for c in children:
            if c.error is not None and self.error is None:
                self.error = c.error
        for k in dict.fromkeys(k for c in children for k in c.vars if k not in inherited):
            self.vars[k] = [c.vars.get(k) for c in children]
            self.meta[k] = [c.meta.get(k) for c in children]
            self.record(op, {k: (self.vars[k], self.meta[k])})

    def _set(self, name: str | None, value, meta, op: int | None = None) -> None:
        if name is not None:
            self.vars[name] = value
            self.meta[name] = meta
            self.record(op, {name: (value, meta)})

    def record(self, op: int | None, values: dict[str, tuple]) -> None:
        if self.history is not None and op is not None:
            self.history.setdefault(op, {}).update(values)

    # ---- forking -------------------------------------------------------------------------------------------
    def child(self) -> "Stream":
        c = Stream(self.backend, self.defaults, self.stream_tokens, self.num_api_spec_tokens)
        c.text, c.messages, c.images = self.text, list(self.messages), list(self.images)
        c.vars, c.meta = dict(self.vars), dict(self.meta)
        c.role, c.role_begin, c.fork_start = self.role, self.role_begin, len(self.text)
        c.history = self.history
        return c


def _convert(out, dtype, name):
    if dtype is None or dtype is str:
        return out
    if isinstance(out, list):
        return [_convert(o, dtype, name) for o in out]
    s = out.strip()
    try:
        return {int: int, float: float, bool: lambda v: {"True": True, "False": False}[v]}[dtype](s)
    except (ValueError, KeyError):
        raise ValueError(f"gen({name!r}, dtype={dtype.__name__}): the model produced {out!r}") from None


class RoleMethods:
    """`s.system(...)`, `s.user(...)`, `s.assistant(...)`: with an argument, the whole turn at once; without, a
    context manager around the turn. Shared by the running state and the tracing state (`_put` differs)."""

    def _put(self, expr) -> None:
        raise NotImplementedError

    def _role(self, role: str, expr=None):
        if expr is not None:
            self._put(ExprList([RoleBegin(role), _as_expr(expr), RoleEnd(role)]))
            return contextlib.nullcontext()
        return self._scope(RoleBegin(role), RoleEnd(role))

    def system(self, expr=None):
        return self._role("system", expr)

    def user(self, expr=None):
        return self._role("user", expr)

    def assistant(self, expr=None):
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def _scope(self, begin: Expr, end: Expr):
        self._put(begin)
        yield self
        self._put(end)


class ProgramState(RoleMethods):
    """The `s` a program writes to. `s += expr` queues work and returns at once; `s["x"]` waits for x."""

    def __init__(self, stream: Stream):
        self._s = stream
        self.ret_value = None

    def __iadd__(self, expr):
        if expr is None:
            raise ValueError("cannot append None to a program state")
        self._s.submit(expr)
        return self

    def __getitem__(self, name: str):
        return self._s.get_var(name)

    def get_var(self, name: str):
        return self._s.get_var(name)

    def __setitem__(self, name: str, value) -> None:
        self._s.vars[name] = value

    set_var = __setitem__

    def __contains__(self, name: str) -> bool:
        return name in self._s.vars

    def get_meta_info(self, name: str):
        self._s.get_var(name)
        return self._s.meta.get(name)

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._s.vars)

    def text(self) -> str:
        self.sync()
        return self._s.text

    def messages(self) -> list[dict]:
        self.sync()
        return list(self._s.messages)

    def sync(self) -> None:
        self._s.sync()

    def error(self) -> BaseException | None:
        return self._s.error

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    # ---- roles, scopes, forks ------------------------------------------------------------------------------
    def _put(self, expr) -> None:
        self._s.submit(expr)

    def var_scope(self, name: str):
        """`with s.var_scope("x"): s += ...` sets x to the text appended inside the block."""
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
        self._s.sync()  # the parent's text is complete before it is copied (SGLang reads it before syncing)
        if size > 1 and self._s.text and self._s.error is None:
            self._s.submit(Commit())  # the shared prefix enters the cache once, before the branches run
            self._s.sync()
        if self._s.error is not None:
            raise self._s.error
        return ProgramStateGroup([ProgramState(self._s.child()) for _ in range(size)], self)

    @contextlib.contextmanager
    def copy(self):
        group = self.fork(1)
        yield group[0]
        group.join()

    # ---- streaming -----------------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the text (or one variable) as it grows, until everything submitted so far has run."""
        s, sent, seen = self._s, 0, -1
        while True:
            seen = s.wait_text_change(seen, timeout=0.5)
            with s._cond:
                cur = s.text if var_name is None else s.vars.get(var_name, "")
                done = s._queued == 0 and getattr(self, "_body_done", True)
            cur = cur if isinstance(cur, str) else ""
            if len(cur) > sent:
                yield cur[sent:]
                sent = len(cur)
            if done:
                if s.error is not None:
                    raise s.error
                return

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False):
        it = self.text_iter(var_name)
        while True:
            chunk = await asyncio.to_thread(next, it, None)
            if chunk is None:
                return
            yield (chunk, self._s.meta.get(var_name)) if return_meta_data else chunk


class ProgramStateGroup:
    """The branches of a fork. `forks += x`: a callable gets each index, a list goes element-wise, anything else
    goes to every branch."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states, self.parent = states, parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state) -> None:
        """`forks[i] += x` appends to branch i, then assigns the branch back (SGLang allows it)."""
        if state is not self.states[i]:
            raise TypeError("a fork's branches cannot be replaced; `forks[i] += ...` appends to branch i")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, x):
        for i, st in enumerate(self.states):
            st += x(i) if callable(x) else (x[i] if isinstance(x, (list, tuple)) else x)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        for st in self.states:
            st.sync()
        parent = self.parent._s
        if mode == "gather_variable":
            parent.gather([st._s for st in self.states])
        elif mode == "concate_and_append":
            parent.submit(ConcatAppend([st._s for st in self.states]))
        else:
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', not {mode!r}")
