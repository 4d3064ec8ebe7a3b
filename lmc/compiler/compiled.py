"""Compiled programs: `prog.compile()` traces the program into segments, runs the passes on each, and executes
them with the plan executor (lmc.compiler.executor).

An instance runs its first segment; at a graph break the segment after it is looked up in a cache behind guards
(the values the host code read, lmc.compiler.trace) and traced on a miss, then run on the same stream. A break
that cannot be resumed by tracing hands the rest of the body to the interpreter (lmc.compiler.interpret).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..frontend.program import Program, _failed_state, _progress, resolve_backend, resolve_defaults
from ..frontend.state import ProgramState, Stream, frontend_loop
from ..ir import ProgramGraph
from ..passes import constant_prefix
from ..passes.cost import estimate, first_prompts, token_aligned_hint
from ..protocol import NO_CAPABILITIES, Capabilities, ChatTemplate, capabilities
from .executor import run_segment
from .lower import Plan, lower
from .interpret import interpret_rest
from .pipeline import PassManager, Target, check_pass_names
from .trace import Resume, Segment, trace_segment

_MISSING = object()
SEGMENT_CACHE_SIZE = 64  # segments kept per resume point (torch.compile's cache_size_limit, in spirit)
# The interpreter fallback blocks a thread per instance while its stream works: a pool as wide as a batch.
_INTERPRETERS = ThreadPoolExecutor(32, thread_name_prefix="lmc-interpret")


def _key(concrete: dict) -> str:
    return repr(sorted(concrete.items()))


def _guards_hold(guards: dict[tuple, Any], resume: Resume) -> bool:
    """Whether an instance at `resume` read the same values as the instance a segment was traced for."""
    for key, value in guards.items():
        if key[0] == "arg":
            current = resume.args.get(key[1], _MISSING)
        else:
            entry = resume.history.get(key[1], {}).get(key[2])
            current = _MISSING if entry is None else entry[0 if key[0] == "var" else 1]
        if current is _MISSING or current != value:
            return False
    return True


def _target(backend) -> Target:
    kind = {"Local": "local", "RuntimeEndpoint": "endpoint", "OpenAI": "openai"}.get(type(backend).__name__, "local")
    return Target(kind, backend.chat_template, getattr(backend, "tokenizer", None), capabilities(backend))


class CompiledProgram:
    """`disable` / `enable`: pass names (lmc.compiler.pipeline.PASSES). The older switches map onto them:
    hoist="off" disables batch_prefix and hoist_suggestions, hoist="aggressive" enables aggressive_hoist, and
    fork_commit / fork_batch / select_lowering=False disable the pass of that name."""

    def __init__(self, program: Program, hoist: str = "safe", fork_commit: bool = True, fork_batch: bool = True,
                 select_lowering: bool = True, disable=(), enable=()):
        if hoist not in ("off", "safe", "aggressive"):
            raise ValueError(f"hoist must be 'off', 'safe' or 'aggressive', not {hoist!r}")
        disable = set(check_pass_names(disable))
        disable |= {"batch_prefix", "hoist_suggestions"} if hoist == "off" else set()
        disable |= {n for n, on in (("fork_commit", fork_commit), ("fork_batch", fork_batch),
                                    ("select_lowering", select_lowering)) if not on}
        enable = set(check_pass_names(enable)) | ({"aggressive_hoist"} if hoist == "aggressive" else set())
        self.program, self.passes = program, PassManager.configure(disable, enable)
        self._options = (tuple(sorted(disable)), tuple(sorted(enable)))
        self._graphs: dict[str, ProgramGraph] = {}
        # (concrete arguments, resume operation) -> the segments traced from there, each behind its guards
        self._segments: dict[tuple[str, int], list[Segment]] = {}
        # (concrete arguments, resume operation) -> resolved when the trace running from there is done; touched on
        # the frontend loop only (every instance runs there)
        self._tracing: dict[tuple[str, int], asyncio.Future] = {}
        self._callees: dict[Program, CompiledProgram] = {}
        self._lock = threading.Lock()
        # trace_seconds: wall time spent tracing segments and running the pass pipeline on them (the compiler's
        # own cost, paid once per path: a segment reused from the cache costs only its guard check)
        self.stats = {"segments_traced": 0, "segment_reuses": 0, "interpreted_rests": 0, "trace_seconds": 0.0}

    def __repr__(self) -> str:
        return f"<compiled {self.program!r}>"

    # ---- tracing -------------------------------------------------------------------------------------------
    def _optimize(self, g: ProgramGraph, target: Target | None = None) -> dict[str, dict]:
        """Run the pass pipeline (the graph-rewriting passes are idempotent: a segment is run through it once
        at tracing and once per backend it runs on)."""
        return self.passes.run(g, target or Target("local", ChatTemplate.plain()))[1]

    def graph(self, **concrete) -> ProgramGraph:
        """The first segment for these non-text arguments (loop counts, lists): one trace per distinct value set."""
        key = _key(concrete)
        with self._lock:
            if key not in self._graphs:
                start = time.perf_counter()
                g = trace_segment(self.program, concrete).graph
                self._optimize(g)
                self._graphs[key] = g
                self.stats["trace_seconds"] += time.perf_counter() - start
            return self._graphs[key]

    def _cached_segment(self, key: tuple[str, int], resume: Resume) -> ProgramGraph | None:
        with self._lock:
            for seg in self._segments.get(key, []):
                if _guards_hold(seg.guards, resume):
                    self.stats["segment_reuses"] += 1
                    return seg.graph
        return None

    def _trace_into_cache(self, key: tuple[str, int], concrete: dict, resume: Resume) -> ProgramGraph:
        start = time.perf_counter()
        seg = trace_segment(self.program, concrete, resume)
        self._optimize(seg.graph)
        with self._lock:
            cached = self._segments.setdefault(key, [])
            if len(cached) < SEGMENT_CACHE_SIZE:  # beyond it, paths that rarely repeat are traced, not kept
                cached.append(seg)
            self.stats["segments_traced"] += 1
            self.stats["trace_seconds"] += time.perf_counter() - start
        return seg.graph

    async def segment(self, concrete: dict, resume: Resume) -> ProgramGraph:
        """The segment after a break for an instance at `resume`: a cached one whose guards hold, or a new trace.

        Single-flight per resume point: while one instance traces from a resume point, the others that reach it
        wait (on the frontend loop, holding no thread) and then look in the cache again, so instances that read the
        same values trace the segment once. A waiter never takes on another's failure: if that trace raised, the
        waiter traces for itself (and meets its own error, if it is one)."""
        key = (_key(concrete), resume.ops)
        while True:
            found = self._cached_segment(key, resume)
            if found is not None:
                return found
            inflight = self._tracing.get(key)
            if inflight is None:
                break
            await inflight  # resolved (never failed) when that trace is done, whatever its outcome
        done = asyncio.get_running_loop().create_future()
        self._tracing[key] = done
        try:
            return await asyncio.to_thread(self._trace_into_cache, key, concrete, resume)
        finally:
            del self._tracing[key]
            done.set_result(None)

    def _split(self, kwargs: dict) -> tuple[dict, dict]:
        """(concrete, symbolic) arguments: text stays symbolic, anything else specialises the graph."""
        concrete = {k: v for k, v in kwargs.items() if not isinstance(v, str)}
        return concrete, {k: v for k, v in kwargs.items() if isinstance(v, str)}

    # ---- reporting -----------------------------------------------------------------------------------------
    def breaks(self, **concrete) -> tuple[bool, list[dict]]:
        """(fallback, graph breaks) of the first segment: fallback when the interpreter runs the whole program."""
        g = self.graph(**concrete)
        found = [g.node(n).attrs for n in g.breaks()]
        fallback = any(b["interpret"] and b["resume"] == 0 for b in found)
        return fallback, [{"line": b["line"], "reason": b["reason"], "resume": b["resume"],
                           **({"interpreted_from_here": True} if b["interpret"] else {})} for b in found]

    def report(self, template=None, tokenizer=None, examples: list[dict] | None = None, **concrete) -> dict:
        """What the compiler found and did, in numbers (token counts when a tokenizer is given; the cost model
        replays `examples`, or two placeholder instances)."""
        g = self.graph(**concrete)
        tmpl = template or resolve_backend(None).chat_template
        fallback, graph_breaks = self.breaks(**concrete)
        stats = self._optimize(g, Target("local", tmpl, tokenizer, NO_CAPABILITIES if tokenizer is None
                                         else Capabilities(token_id_selects=True)))
        batch_prefix = "batch_prefix" in stats
        inst = examples or [{}, {}]
        prefix = constant_prefix(g, tmpl, examples) if batch_prefix else ""
        if prefix and tokenizer is not None:  # the hint the engine can serve whole: cut to a token boundary
            prefix = token_aligned_hint(prefix, first_prompts(g, tmpl, inst), tokenizer.encode)
        commits = stats.get("fork_commit", {}).get("plan", {}).get("commits", {})
        speculation = stats.get("api_speculation", {"completion_groups": [], "chat_groups": []})
        count = (lambda t: len(tokenizer.encode(t))) if tokenizer is not None else len
        unit = "tokens" if tokenizer is not None else "chars"
        report = {"nodes": len(g), "fallback": fallback, "graph_breaks": graph_breaks,
                  "branches": g.count("branch"), "forks": g.count("fork"),
                  "prefix_hoist": {f"batch_prefix_{unit}": count(prefix) if prefix else 0,
                                   f"fork_shared_{unit}": {f"%{k}": count(v) if v else 0 for k, v in commits.items()},
                                   "suggestions": [{"node": f"%{x['node']}", "text": x["text"],
                                                    f"shareable_{unit}": count(x["text"])}
                                                   for x in stats.get("hoist_suggestions", {}).get("suggestions", [])]},
                  "api_speculation": {k: [[f"%{n}" for n in grp] for grp in v] for k, v in speculation.items()},
                  "passes": list(self.passes.enabled)}
        if tokenizer is not None:
            lowered = stats.get("select_lowering", {}).get("plan", {}).get("select_tokens", {})
            report["select_lowering"] = {f"%{n}": len(ids) for n, ids in sorted(lowered.items())}
            tok = lambda t: tokenizer.encode(t)  # noqa: E731
            report["cost"] = {
                "no_cache": estimate(g, tmpl, tok, inst, cache=False).as_dict(),
                "radix_cache": estimate(g, tmpl, tok, inst).as_dict(),
                "radix_cache_and_passes": estimate(g, tmpl, tok, inst, batch_prefix=prefix, fork_commits=commits,
                                                   lowered_selects=frozenset(lowered)).as_dict()}
            worse = report["cost"]["radix_cache_and_passes"]["prefill_tokens"] - \
                report["cost"]["radix_cache"]["prefill_tokens"]
            if worse > 0:  # a pass never makes the estimate worse without saying why
                report["cost"]["note"] = (
                    f"the passes add {worse} prefill tokens here: their hints (batch prefix, fork commits) are "
                    f"prefill calls of their own, which {len(inst)} instances do not amortise")
        else:
            report["cost"] = {"note": "no tokenizer (transformers is not installed, or the model has none): sizes "
                                      "are in characters; select lowering and the token cost model need one"}
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
        """Run every instance at once: all of them walk their segments concurrently on the frontend loop, whatever
        their non-text arguments, so the engine's scheduler sees every instance's frontier."""
        items = [self.program._arguments(tuple(b), {}) if isinstance(b, (list, tuple)) else
                 self.program._arguments((), dict(b)) for b in batch_kwargs]
        if not items:
            return []
        backend = resolve_backend(backend)
        defaults = resolve_defaults(sampling)
        progress = _progress(len(items), progress_bar, self.program.__name__)
        graphs = [self.graph(**self._split(kw)[0]) for kw in items]  # traced here, not on the loop
        coro = self._run_all(items, graphs, backend, defaults, progress)
        results = asyncio.run_coroutine_threadsafe(coro, frontend_loop()).result()
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
        if not self._plan(g, backend).batch_prefix or len(items) < 2 or capabilities(backend).batch_prefix_sharing:
            return ""
        return constant_prefix(g, backend.chat_template, items)

    async def _run_all(self, items: list[dict], graphs: list[ProgramGraph], backend, defaults, progress) -> list:
        for g in {id(g): g for g in graphs}.values():
            prefix = self._batch_prefix(g, [kw for kw, h in zip(items, graphs) if h is g], backend)
            if prefix:  # prefilled once, ahead of the instances (a hint: not awaited, it is queued first)
                asyncio.ensure_future(backend.commit(prefix))

        async def one(kw, g):
            try:
                return await self._instance(kw, g, backend, defaults)
            finally:
                progress.update()

        return await asyncio.gather(*(one(kw, g) for kw, g in zip(items, graphs)), return_exceptions=True)

    async def _instance(self, kwargs: dict, g: ProgramGraph, backend, defaults) -> ProgramState:
        """One instance: its segments one after another on one stream, the host code between them traced (or
        the cached trace reused) off the loop."""
        stream = Stream(backend, defaults, num_api_spec_tokens=self.program.num_api_spec_tokens)
        stream.history = {}
        concrete, text_args = self._split(kwargs)
        args = dict(kwargs)  # the arguments, and the outputs of the program's nested calls
        while True:
            brk = await run_segment(self._plan(g, backend), args, stream)
            if brk is None or stream.error is not None:
                break
            attrs = g.node(brk).attrs
            resume = Resume(attrs["resume"], stream.history, text_args)
            if attrs["interpret"]:
                self.stats["interpreted_rests"] += 1
                await asyncio.get_running_loop().run_in_executor(_INTERPRETERS, interpret_rest, self.program, stream,
                                                                 resume, kwargs)
                break
            g = await self.segment(concrete, resume)
        return ProgramState(stream)

    def plan_for(self, target: Target, **concrete) -> Plan:
        """The executor's plan for the first segment on `target` (what `lmc compile --emit plan` prints)."""
        g = self.graph(**concrete)
        return self._make_plan(g, target)

    def _plan(self, g: ProgramGraph, backend) -> Plan:
        """The executor's plan for one segment on one backend: what the passes decided, for that target."""
        held = g.plans.get(id(backend))
        if held is not None and held[0] is backend:
            return held[1]
        plan = self._make_plan(g, _target(backend))
        g.plans[id(backend)] = (backend, plan)  # lives as long as the segment does
        return plan

    def _make_plan(self, g: ProgramGraph, target: Target) -> Plan:
        plan = lower(g, target, self._optimize(g, target), self.program.num_api_spec_tokens)
        for name, program in g.callees.items():  # nested programs compile with the caller's options
            with self._lock:
                if program not in self._callees:
                    self._callees[program] = CompiledProgram(program, disable=self._options[0],
                                                             enable=self._options[1])
            plan.callees[name] = self._callees[program]
        return plan

    async def arun_instance(self, kwargs: dict, backend, defaults) -> ProgramState:
        """One instance, called from another program's plan (a `call` node) with the caller's backend and
        sampling defaults."""
        g = await asyncio.to_thread(self.graph, **self._split(kwargs)[0])
        return await self._instance(kwargs, g, backend, defaults)
