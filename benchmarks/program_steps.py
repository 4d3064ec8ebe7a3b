"""Where a program instance's wall time goes, step by step: per scheduler step its wall, the wait inside collect
(the GPU still busy), the worker thread's host time in each forward (decode or extend) and in sampling; the idle
time between steps; and the GPU's kernel-busy time over one run (torch.profiler). Compiled over /v1/programs and
interpreted over RuntimeEndpoint, on a server in this process (ServerThread: one clock).

    python benchmarks/program_steps.py OUT.json chain6,tree_of_thought REPS     (from the tree whose lmc it times)

M=<model> picks the model (default: the embedded one); BENCH=<dir> where programs_bench.py is, for an older tree
without it (its lmc is imported first, from the working directory). PROF=1 also prints a cProfile of the
scheduler steps of 10 compiled chain6 instances. program_timeline.py splits an instance by HTTP phase; this by
step: an extend's forward costs the host more than a decode step's replay, and at a chain's boundary nothing else
is queued, so the GPU waits for it (benchmarks/results/h100_probe/README.md)."""
import json, os, statistics, sys, time
R = os.getcwd(); sys.path[:0] = [R, R + "/examples", R + "/tests", os.environ.get("BENCH", R + "/benchmarks")]
import torch
import lmc  # (from the working directory: before programs_bench, which puts its own tree first on the path)
from lmc.runtime.engine import Engine
from lmc.server import ServerThread, create_app
from programs_bench import workloads
print("lmc from", lmc.__file__, flush=True)

out_path = sys.argv[1]; names = sys.argv[2].split(","); reps = int(sys.argv[3])
eng = Engine(model=os.environ.get("M", "smollm2-135m-instruct"), max_total_tokens=65536 if torch.cuda.is_available() else None)
sch, run = eng.scheduler, eng.runner
ev = []
def wrap(owner, name, label, info=None):
    fn = getattr(owner, name)
    def w(*a, **k):
        t0 = time.perf_counter()
        try: return fn(*a, **k)
        finally: ev.append((label, t0, time.perf_counter(), info(*a) if info else None))
    setattr(owner, name, w)
wrap(sch, "step", "step")
wrap(run, "collect", "collect")
wrap(run, "_forward", "forward", lambda host, sizes, shape: (bool(shape[0]), sizes[0], shape[3]))
wrap(run, "_sample", "sample")
wrap(sch, "_process", "process")
wrap(sch, "finish", "finish")
wrap(sch, "_schedule_prefill", "sched_prefill")
wrap(sch, "_schedule_decode", "sched_decode")
wrap(run, "launch", "launch")
wrap(run, "_logprobs", "logprobs")
wrap(sch._continuation, "advance", "advance")
srv = ServerThread(create_app(eng)).start(); ep = lmc.RuntimeEndpoint(srv.url)

def summarize(evs, wall):
    steps = [(a, b) for l, a, b, _ in evs if l == "step"]
    s = lambda l: sum(b - a for x, a, b, _ in evs if x == l) * 1e3
    fw = [i for l, a, b, i in evs if l == "forward"]
    idle = sum(max(0, steps[i + 1][0] - steps[i][1]) for i in range(len(steps) - 1)) * 1e3 if steps else 0
    eager = [i for i in fw if not i[0]]
    fw_ms_dec = [(b - a) * 1e3 for l, a, b, i in evs if l == "forward" and i[0]]
    fw_ms_ext = [(b - a) * 1e3 for l, a, b, i in evs if l == "forward" and not i[0]]
    return {"wall": wall, "steps": len(steps), "step_ms": s("step"), "collect_ms": s("collect"), "forward_host_ms": s("forward"),
            "sample_host_ms": s("sample"), "idle_between_steps_ms": idle,
            "first_step_to_last_ms": (steps[-1][1] - steps[0][0]) * 1e3 if steps else 0,
            "decode_forwards": len(fw_ms_dec), "extend_forwards": len(eager), "extend_tokens": [i[2] for i in eager],
            "forward_host_ms_decode_median": statistics.median(fw_ms_dec) if fw_ms_dec else None,
            "forward_host_ms_extend": [round(x, 3) for x in fw_ms_ext]}

res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "programs": {}}
for name in names:
    prog, kw = workloads()[name]
    comp = prog.compile()
    ways = {"compiled": lambda: comp.run(**kw, backend=ep, temperature=0),
            "interpreted": lambda: prog.run(**kw, backend=ep, temperature=0)}
    for way, f in ways.items():
        for _ in range(3): f()
        runs = []
        for _ in range(reps):
            ev.clear(); t = time.perf_counter(); f(); wall = (time.perf_counter() - t) * 1e3
            runs.append(summarize(list(ev), wall))
        keep = {k: statistics.median([r[k] for r in runs]) for k in runs[0] if isinstance(runs[0][k], (int, float))}
        keep["example_run"] = runs[-1]
        ev.clear(); t = time.perf_counter(); f(); keep["timeline_example"] = [(l, round((a - t) * 1e3, 3), round((b - t) * 1e3, 3), i) for l, a, b, i in ev]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [torch.profiler.ProfilerActivity.CPU]) as pr:
            t = time.perf_counter(); f(); torch.cuda.is_available() and torch.cuda.synchronize(); pw = (time.perf_counter() - t) * 1e3
        kev = sorted([e for e in pr.events() if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
        busy, end = 0, -1
        for e in kev:
            s0, e0 = e.time_range.start, e.time_range.end
            if s0 > end: busy += e0 - s0; end = e0
            elif e0 > end: busy += e0 - end; end = e0
        keep["gpu_busy_ms_profiled_run"] = busy / 1e3; keep["profiled_wall_ms"] = pw; keep["kernels"] = len(kev)
        res["programs"].setdefault(name, {})[way] = keep
        print(name, way, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in keep.items() if not isinstance(v, (list, dict))}, flush=True)
if os.environ.get("PROF"):
    import cProfile, io, pstats
    prof = cProfile.Profile()
    inner = sch.step
    def pstep(*a, **k):
        prof.enable()
        try: return inner(*a, **k)
        finally: prof.disable()
    sch.step = pstep
    prog, kw = workloads()["chain6"]; comp = prog.compile()
    for _ in range(10): comp.run(**kw, backend=ep, temperature=0)
    for key in ("tottime", "cumtime"):
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(key).print_stats(60); print(s.getvalue()[:20000])
    s = io.StringIO(); st = pstats.Stats(prof, stream=s).sort_stats("cumtime")
    for f in ("_forward", "replay_extend", "_replay_chunk", "_process$", "finish", "advance", "schedule_prefill", "launch$", "collect", "_logprobs", "plan_select", "_admit"):
        st.print_callees(f)
    print(s.getvalue()[:60000])
json.dump(res, open(out_path, "w"), indent=1)
srv.stop(); eng.shutdown()
