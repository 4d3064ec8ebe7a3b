"""Compiled programs: `prog.compile()` traces the program into a ProgramGraph, runs the passes, and executes the
graph with the plan executor (lmc.backend.executor). A graph with a dynamic region runs in the interpreter, with
the hints the passes could still give (the batch's constant prefix prefilled once)."""
from __future__ import annotations

import asyncio
from typing import Any

from ..ir import ProgramGraph
from ..passes import constant_prefix, fork_commit_texts
from ..passes.api_speculation import plan_speculation
from ..passes.cost import estimate
from ..passes.prefix_hoist import apply_aggressive_hoist, canonicalize_unordered, hoist_suggestions
from ..passes.select_lowering import single_token_selects
from .program import Program, _caller, _failed_state, _progress, resolve_backend, resolve_defaults
from .state import ProgramState, frontend_loop
from .tracer import trace


class CompiledProgram:
    def __init__(self, program: Program, hoist: str = "safe", fork_commit: bool = True, fork_batch: bool = True,
                 select_lowering: bool = True):
        if hoist not in ("off", "safe", "aggressive"):
            raise ValueError(f"hoist must be 'off', 'safe' or 'aggressive', not {hoist!r}")
        self.program, self.hoist, self.fork_commit = program, hoist != "off", fork_commit
        self.hoist_mode, self.fork_batch, self.select_lowering = hoist, fork_batch, select_lowering
        self._graphs: dict[Any, ProgramGraph] = {}
        self._callees: dict[Program, CompiledProgram] = {}
        self.pass_stats: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"<compiled {self.program!r}>"

    def graph(self, **concrete) -> ProgramGraph:
        """The graph for these non-text arguments (loop counts, lists): one trace per distinct value set."""
        key = repr(sorted(concrete.items()))
        if key not in self._graphs:
            g = trace(self.program, **concrete)
            self.pass_stats = {"suggestions": hoist_suggestions(g)}
            if self.hoist:
                self.pass_stats["unordered_canonicalised"] = canonicalize_unordered(g)
            if self.hoist_mode == "aggressive":
                self.pass_stats["hoisted_nodes"] = apply_aggressive_hoist(g)
            self._graphs[key] = g
        return self._graphs[key]

    def _split(self, kwargs: dict) -> tuple[dict, dict]:
        """(concrete, symbolic) arguments: text stays symbolic, anything else specialises the graph."""
        concrete = {k: v for k, v in kwargs.items() if not isinstance(v, str)}
        return concrete, {k: v for k, v in kwargs.items() if isinstance(v, str)}

    def report(self, template=None, tokenizer=None, examples: list[dict] | None = None, **concrete) -> dict:
        """What the compiler found and did, in numbers (token counts when a tokenizer is given; the cost model
        replays `examples`, or two placeholder instances)."""
        g = self.graph(**concrete)
        tmpl = template or resolve_backend(None).chat_template
        dynamic = [g.node(n).attrs for n in g.order() if g.node(n).kind == "dynamic"]
        static_nodes = len(g) - len(dynamic)
        prefix = constant_prefix(g, tmpl) if self.hoist else ""
        commits = fork_commit_texts(g, tmpl) if self.fork_commit else {}
        count = (lambda t: len(tokenizer.encode(t))) if tokenizer is not None else len
        unit = "tokens" if tokenizer is not None else "chars"
        report = {"nodes": len(g), "static": not dynamic, "static_nodes": static_nodes, "dynamic": dynamic,
                  "branches": g.count("branch"), "forks": g.count("fork"),
                  "prefix_hoist": {f"batch_prefix_{unit}": count(prefix) if prefix else 0,
                                   f"fork_shared_{unit}": {f"%{k}": count(v) if v else 0 for k, v in commits.items()},
                                   "unordered_canonicalised": self.pass_stats.get("unordered_canonicalised", 0),
                                   "suggestions": [{"node": f"%{x['node']}", "text": x["text"],
                                                    f"shareable_{unit}": count(x["text"])}
                                                   for x in self.pass_stats.get("suggestions", [])]},
                  "api_speculation": {"completion_groups": [[f"%{n}" for n in grp] for grp in plan_speculation(g, False)],
                                      "chat_groups": [[f"%{n}" for n in grp] for grp in plan_speculation(g, True)]}}
        if tokenizer is not None:
            lowered = single_token_selects(g, tmpl, tokenizer) if self.select_lowering else {}
            report["select_lowering"] = {f"%{n}": len(ids) for n, ids in sorted(lowered.items())}
            tok = lambda t: tokenizer.encode(t)  # noqa: E731
            inst = examples or [{}, {}]
            if examples and self.hoist:
                prefix = constant_prefix(g, tmpl, examples)
            report["cost"] = {
                "no_cache": estimate(g, tmpl, tok, inst, cache=False).as_dict(),
                "radix_cache": estimate(g, tmpl, tok, inst).as_dict(),
                "radix_cache_and_passes": estimate(g, tmpl, tok, inst, batch_prefix=prefix, fork_commits=commits,
                                                   lowered_selects=frozenset(lowered)).as_dict()}
        return report

    # ---- running -------------------------------------------------------------------------------------------
    def run(self, *args, backend=None, **kwargs) -> ProgramState:
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k not in self.program.arg_names}
        states = self.run_batch([self.program._arguments(args, kwargs)], backend=backend, **sampling)
        if states[0].error() is not None:
            raise states[0].error()
        return states[0]

    def run_batch(self, batch_kwargs: list, *, backend=None, progress_bar: bool = False,
                  return_exceptions: bool = False, **sampling) -> list:
        items = [self.program._arguments(tuple(b), {}) if isinstance(b, (list, tuple)) else
                 self.program._arguments((), dict(b)) for b in batch_kwargs]
        if not items:
            return []
        backend = resolve_backend(backend)
        groups: dict[str, list[int]] = {}
        for i, kw in enumerate(items):
            groups.setdefault(repr(sorted(self._split(kw)[0].items())), []).append(i)
        results: list = [None] * len(items)
        progress = _progress(len(items), progress_bar, self.program.__name__)
        for idx in groups.values():
            concrete, _ = self._split(items[idx[0]])
            g = self.graph(**concrete)
            if g.static():
                coro = self._run_static(g, [items[i] for i in idx], backend, sampling, progress)
                outs = asyncio.run_coroutine_threadsafe(coro, frontend_loop()).result()
            else:
                self._commit_prefix(g, [items[i] for i in idx], backend)
                outs = self.program.run_batch([items[i] for i in idx], backend=self._interpreter_backend(g, backend),
                                              return_exceptions=True, **sampling)
                progress.update(len(idx))
            for i, out in zip(idx, outs):
                results[i] = out
        progress.close()
        if not return_exceptions:
            results = [r if isinstance(r, ProgramState) else _failed_state(r) for r in results]
        else:
            results = [r.error() if isinstance(r, ProgramState) and r.error() is not None else r for r in results]
        return results

    async def arun_batch(self, batch_kwargs: list, **kwargs) -> list:
        return await asyncio.to_thread(self.run_batch, batch_kwargs, **kwargs)

    def _batch_prefix(self, g: ProgramGraph, items: list[dict], backend) -> str:
        """The prefix a batch's instances share, to prefill once ahead of them; none where the engine already
        computes a shared prefix once among queued requests (the first instance's whole prompt then serves the
        others, and it usually shares more than the hint would)."""
        if not self.hoist or len(items) < 2 or getattr(backend, "shares_prefixes_in_batch", False):
            return ""
        return constant_prefix(g, backend.chat_template, items)

    def _commit_prefix(self, g: ProgramGraph, items: list[dict], backend) -> None:
        prefix = self._batch_prefix(g, items, backend)
        if prefix:
            asyncio.run_coroutine_threadsafe(backend.commit(prefix), frontend_loop()).result()

    async def _run_static(self, g: ProgramGraph, items: list[dict], backend, sampling: dict, progress) -> list:
        from ..backend.executor import run_graph

        defaults = resolve_defaults(sampling)
        plan = self._plan(g, backend)
        prefix = self._batch_prefix(g, items, backend)
        if prefix:  # prefilled once, ahead of the instances (a hint: not awaited, it is queued first)
            asyncio.ensure_future(backend.commit(prefix))

        async def one(kw):
            try:
                return await run_graph(g, dict(kw), backend, defaults, plan, self.program.num_api_spec_tokens)
            finally:
                progress.update()

        return await asyncio.gather(*(one(kw) for kw in items), return_exceptions=True)

    def _plan(self, g: ProgramGraph, backend):
        from ..backend.executor import Plan

        plan = Plan(fork_commit_texts(g, backend.chat_template) if self.fork_commit else {}, self.fork_batch)
        if self.select_lowering and hasattr(backend, "select_tokens"):
            plan.select_tokens = single_token_selects(g, backend.chat_template, backend.tokenizer)
        for name, program in g.callees.items():  # nested programs compile with the caller's options
            if program not in self._callees:
                self._callees[program] = CompiledProgram(program, self.hoist_mode, self.fork_commit, self.fork_batch,
                                                         self.select_lowering)
            plan.callees[name] = self._callees[program]
        return plan

    def _interpreter_backend(self, g: ProgramGraph, backend):
        """The backend a program with a dynamic region is interpreted on: with the selects the plan lowered."""
        if not (self.select_lowering and hasattr(backend, "select_tokens")):
            return backend
        plan = {tuple(g.node(n).attrs["choices"]): ids
                for n, ids in single_token_selects(g, backend.chat_template, backend.tokenizer).items()}
        return _LoweredSelects(backend, plan) if plan else backend

    async def arun_instance(self, kwargs: dict, backend, defaults) -> ProgramState:
        """One instance, called from another program's plan (a `call` node) with the caller's backend and
        sampling defaults: the plan executor if its graph is static, else the interpreter."""
        from ..backend.executor import run_graph

        g = self.graph(**self._split(kwargs)[0])
        if g.static():
            return await run_graph(g, kwargs, backend, defaults, self._plan(g, backend),
                                   self.program.num_api_spec_tokens)

        def interpret():
            token = _caller.set((self._interpreter_backend(g, backend), defaults))
            try:
                return self.program.run(**kwargs)
            finally:
                _caller.reset(token)

        return await asyncio.to_thread(interpret)


class _LoweredSelects:
    """A backend whose selects use the plan's lowering, for the interpreter: its selects carry no node ids, so the
    plan is keyed by the choices (safe: the backend checks every real prompt's tokenization and falls back)."""

    def __init__(self, backend, plan: dict[tuple[str, ...], list[int]]):
        self._backend, self._plan = backend, plan

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def __repr__(self) -> str:
        return repr(self._backend)

    async def select(self, text, choices, temperature, method):
        ids = self._plan.get(tuple(choices))
        decision = None if ids is None else await self._backend.select_tokens(text, choices, ids, method)
        return decision or await self._backend.select(text, choices, temperature, method)
