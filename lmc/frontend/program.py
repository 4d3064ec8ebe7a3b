"""`@function` programs: run, run_batch, their async forms, bind, and the default backend.

Fixed here, compared with SGLang's frontend:
- `bind` keeps `num_api_spec_tokens`;
- a nested program call uses the caller's backend and sampling defaults, not the global default;
- `run_batch` uses at most `num_threads` (default 32) threads: program bodies only queue work, the streams
  run on the shared frontend loop, so few threads keep every program in flight;
- one failing program never stops the batch (`return_exceptions`, `max_errors`).
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import fields
from typing import Any, Callable

from .primitives import DEFAULT_PARAMS, GenParams
from .state import ProgramState, Stream

_default_backend = None
# (backend, defaults) of the program body running in this thread: nested calls inherit them.
_caller: contextvars.ContextVar = contextvars.ContextVar("lmc_caller", default=None)
_SAMPLING_ARGS = {f.name for f in fields(GenParams)} - {"regex", "json_schema", "dtype"}
# The tracer or replay a program body runs under (set by lmc.compiler): it decides what a nested program call
# becomes (`call(...)`, `nested_run(...)`). None: a plain run.
tracing: contextvars.ContextVar = contextvars.ContextVar("lmc_tracing", default=None)
# Program.compile's implementation, registered by lmc.compiler (which lmc/__init__ imports): the frontend does not
# import the compiler, which builds on it.
_compiler: Callable | None = None


def register_compiler(factory: Callable) -> None:
    global _compiler
    _compiler = factory


def set_default_backend(backend) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend():
    return _default_backend


def flush_cache(backend=None) -> bool:
    b = backend or _default_backend
    if b is None:
        raise RuntimeError("no backend: pass one or call lmc.set_default_backend(...)")
    return b.flush_cache()


def resolve_backend(backend=None):
    """The given backend, else the calling program's (nested calls), else the default one."""
    caller = _caller.get()
    backend = backend or (caller[0] if caller else None) or _default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call lmc.set_default_backend(lmc.Local())")
    return backend


def resolve_defaults(sampling: dict) -> GenParams:
    """Program-level sampling defaults: the given ones over the calling program's (or SGLang's defaults)."""
    caller = _caller.get()
    explicit = {k: v for k, v in sampling.items() if v is not None}
    return GenParams(**explicit).merged_over(caller[1] if caller else DEFAULT_PARAMS)


class BatchAborted(RuntimeError):
    """A program of a run_batch that was not started because max_errors was reached."""


class Program:
    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None):
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise TypeError(f"@lmc.function {func.__name__}: the first parameter must be named `s`")
        self.func, self.num_api_spec_tokens = func, num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = params[1:]
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"<lmc program {self.func.__name__}({', '.join(self.arg_names)})>"

    def bind(self, **kwargs) -> "Program":
        return Program(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    # ---- running -------------------------------------------------------------------------------------------
    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.__name__} takes {len(self.arg_names)} argument(s), got {len(args)}")
        return {**self.bind_arguments, **dict(zip(self.arg_names, args)), **kwargs}

    def _start(self, args: tuple, kwargs: dict, sampling: dict, backend, stream: bool = False) -> ProgramState:
        """Create the stream and run the body (in this thread, or a new one when streaming). Does not wait for
        the queued work."""
        if tracing.get() is not None:
            tracing.get().nested_run(self)
        backend, defaults = resolve_backend(backend), resolve_defaults(sampling)
        state = ProgramState(Stream(backend, defaults, stream, self.num_api_spec_tokens))
        arguments = self._arguments(args, kwargs)

        def body():
            token = _caller.set((backend, defaults))
            try:
                state.ret_value = self.func(state, **arguments)
            except Exception as e:
                state._s.error = state._s.error or e
                raise
            finally:
                _caller.reset(token)
                state._body_done = True

        if stream:
            state._body_done = False
            threading.Thread(target=lambda: _swallow(body), name=f"lmc-{self.__name__}", daemon=True).start()
        else:
            body()
        return state

    def run(self, *args, max_new_tokens: int = None, n: int = None, stop=None, stop_token_ids=None,
            temperature: float = None, top_p: float = None, top_k: int = None, min_p: float = None,
            frequency_penalty: float = None, presence_penalty: float = None, ignore_eos: bool = None,
            return_logprob: bool = None, logprob_start_len: int = None, top_logprobs_num: int = None,
            seed: int = None, stream: bool = False, backend=None, **kwargs) -> ProgramState:
        """Run the program; `kwargs` are its arguments, the named options its sampling defaults (each gen may
        override them). Returns when every queued gen has finished (at once with stream=True); an error raised
        in the program or by a gen is raised here."""
        sampling = dict(max_new_tokens=max_new_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
                        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        ignore_eos=ignore_eos, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                        top_logprobs_num=top_logprobs_num, seed=seed)
        ctx = tracing.get()
        traced = None if ctx is None else ctx.call(self, args, kwargs, sampling, stream)
        if traced is not None:  # called from a program being compiled: a `call` node, not a run
            return traced
        state = self._start(args, kwargs, sampling, backend, stream)
        if not stream:
            state.sync()
            if state.error() is not None:
                raise state.error()
        return state

    __call__ = run

    def run_batch(self, batch_kwargs: list, *, backend=None, num_threads: int | str = "auto",
                  progress_bar: bool = False, return_exceptions: bool = False, max_errors: int | None = None,
                  **sampling) -> list:
        """Run the program once per item (a dict of arguments, or a tuple/list of positional ones).

        Returns one ProgramState per item, in order. A program that fails does not stop the others: its state
        carries the error (`state.error()`; reading its variables raises it), or, with return_exceptions=True, the
        exception takes its place. After `max_errors` failures the programs not yet started are skipped
        (BatchAborted)."""
        unknown = set(sampling) - _SAMPLING_ARGS
        if unknown:
            raise TypeError(f"run_batch got unknown option(s) {sorted(unknown)}")
        items = [(tuple(b), {}) if isinstance(b, (list, tuple)) else ((), dict(b)) for b in batch_kwargs]
        if not items:
            return []
        threads = min(32, len(items)) if num_threads == "auto" else max(1, min(int(num_threads), 63))
        results: list = [None] * len(items)
        errors = 0
        lock = threading.Lock()

        def start(i: int):
            nonlocal errors
            with lock:
                if max_errors is not None and errors >= max_errors:
                    results[i] = BatchAborted(f"not run: max_errors={max_errors} reached")
                    return None
            try:
                return self._start(items[i][0], items[i][1], sampling, backend)
            except Exception as e:
                with lock:
                    errors += 1
                results[i] = e
                return None

        progress = _progress(len(items), progress_bar, self.__name__)
        with ThreadPoolExecutor(threads, thread_name_prefix="lmc-batch") as pool:
            started = {pool.submit(start, i): i for i in range(len(items))}
            idle = {}
            for f in as_completed(started):
                i, state = started[f], f.result()
                if state is None:
                    progress.update()
                else:
                    idle[state._s.when_idle()] = (i, state)
            for f in as_completed(idle):
                i, state = idle[f]
                err = state.error()
                if err is not None:
                    with lock:
                        errors += 1
                results[i] = err if err is not None and return_exceptions else state
                progress.update()
        progress.close()
        if not return_exceptions:
            results = [r if isinstance(r, ProgramState) else _failed_state(r) for r in results]
        return results

    def compile(self, hoist: str = "safe", fork_commit: bool = True, fork_batch: bool = True,
                select_lowering: bool = True, disable=(), enable=()):
        """A compiled program (run / run_batch / arun_batch), traced into segments on first use. `disable` /
        `enable`: pass names (`lmc compile --passes` lists them). `hoist`: "safe" (only meaning-preserving
        moves), "aggressive" (also the suggested ones), or "off"; the other flags switch single passes off."""
        return _compiler(self, hoist=hoist, fork_commit=fork_commit, fork_batch=fork_batch,
                         select_lowering=select_lowering, disable=disable, enable=enable)

    async def arun(self, *args, **kwargs) -> ProgramState:
        return await asyncio.to_thread(self.run, *args, **kwargs)

    async def arun_batch(self, batch_kwargs: list, **kwargs) -> list:
        return await asyncio.to_thread(self.run_batch, batch_kwargs, **kwargs)


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """Decorator: `@lmc.function` or `@lmc.function(num_api_spec_tokens=64)`."""
    if func is None:
        return lambda f: Program(f, num_api_spec_tokens)
    return Program(func, num_api_spec_tokens)


def _swallow(fn: Callable) -> None:
    try:
        fn()
    except Exception:
        pass  # recorded on the state: text_iter / reads raise it


def _failed_state(exc: BaseException) -> ProgramState:
    """A state for a program that never ran (its body raised before queuing anything, or it was skipped)."""
    stream = Stream(None)
    stream.error = exc
    return ProgramState(stream)


def _progress(total: int, enabled: bool, name: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=name, disable=not enabled, unit="program")
