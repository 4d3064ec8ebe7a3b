"""Where a program instance's wall time goes, step by step: per scheduler step its wall, the wait inside collect
(the GPU still busy), the worker thread's host time in each forward (decode or extend) and in sampling; the idle
time between steps; and the GPU's kernel-busy time over one run (torch.profiler). Compiled over /v1/programs and
interpreted over RuntimeEndpoint, on a server in this process (ServerThread: one clock).

    python benchmarks/program_steps.py OUT.json chain6,tree_of_thought REPS     (from the tree whose lmc it times)

M=<model> picks the model (default: the embedded one); BENCH=<dir> where programs_bench.py is, for an older tree
without it (its lmc is imported first, from the working directory). PROF=1 also prints a cProfile of the
scheduler steps of 10 compiled chain6 instances. program_timeline.py splits an instance by HTTP phase; this by
step: an extend's forward costs the host more than a decode step's replay, and at a chain's boundary nothing else
is queued, so the GPU waits for it (benchmarks/results/h100_probe/README.md).
"""
import json
import os
import statistics
import sys
import time

R = os.getcwd()
sys.path[:0] = [R, R + "/examples", R + "/tests", os.environ.get("BENCH", R + "/benchmarks")]

import torch  # noqa: E402

import lmc  # noqa: E402  (from the working directory: before programs_bench, which puts its own tree first)
from lmc.runtime.engine import Engine  # noqa: E402
from lmc.server import ServerThread, create_app  # noqa: E402
from programs_bench import workloads  # noqa: E402


def wrap(owner, name: str, label: str, events: list, info=None) -> None:
    """Record (label, start, end, info(*args)) in `events` around each call of owner.name."""
    fn = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            events.append((label, t0, time.perf_counter(), info(*a) if info else None))
    setattr(owner, name, timed)


def summarize(events: list, wall: float) -> dict:
    """One instance's steps (ms): their wall, collect waits, the forwards' and sampling's host time, the idle time
    between steps; each forward is (is_decode, requests, tokens)."""
    steps = [(a, b) for label, a, b, _ in events if label == "step"]
    total = lambda lab: sum(b - a for x, a, b, _ in events if x == lab) * 1e3  # noqa: E731
    forwards = [(i, (b - a) * 1e3) for label, a, b, i in events if label == "forward"]
    decode = [ms for i, ms in forwards if i[0]]
    extend = [(i, ms) for i, ms in forwards if not i[0]]
    return {"wall": wall, "steps": len(steps), "step_ms": total("step"), "collect_ms": total("collect"),
            "forward_host_ms": total("forward"), "sample_host_ms": total("sample"),
            "idle_between_steps_ms": sum(max(0, steps[k + 1][0] - steps[k][1]) for k in range(len(steps) - 1)) * 1e3,
            "first_step_to_last_ms": (steps[-1][1] - steps[0][0]) * 1e3 if steps else 0,
            "decode_forwards": len(decode), "extend_forwards": len(extend),
            "extend_tokens": [i[2] for i, _ in extend],
            "forward_host_ms_decode_median": statistics.median(decode) if decode else None,
            "forward_host_ms_extend": [round(ms, 3) for _, ms in extend]}


def gpu_busy_ms(run) -> tuple[float, float, int]:
    """(kernel-busy ms, wall ms, kernels) of one call of run() under torch.profiler (0 busy on the CPU)."""
    cuda = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as pr:
        t = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    kernels = sorted((e for e in pr.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy, end = 0, -1
    for e in kernels:  # the union of the kernels' intervals
        s0, e0 = e.time_range.start, e.time_range.end
        busy += e0 - max(s0, end) if e0 > end else 0
        end = max(end, e0)
    return busy / 1e3, wall, len(kernels)


def profile_chain6(sch, ep) -> None:
    import cProfile
    import io
    import pstats

    prof, inner = cProfile.Profile(), sch.step

    def step(*a, **k):
        prof.enable()
        try:
            return inner(*a, **k)
        finally:
            prof.disable()
    sch.step = step
    prog, kw = workloads()["chain6"]
    comp = prog.compile()
    for _ in range(10):
        comp.run(**kw, backend=ep, temperature=0)
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(60)
        print(s.getvalue()[:20000])


def main():
    out_path, names, reps = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    print("lmc from", lmc.__file__, flush=True)
    eng = Engine(model=os.environ.get("M", "smollm2-135m-instruct"),
                 max_total_tokens=65536 if torch.cuda.is_available() else None)
    sch, run, ev = eng.scheduler, eng.runner, []
    wrap(sch, "step", "step", ev)
    wrap(run, "collect", "collect", ev)
    wrap(run, "_forward", "forward", ev, lambda host, sizes, shape: (bool(shape[0]), sizes[0], shape[3]))
    wrap(run, "_sample", "sample", ev)
    srv = ServerThread(create_app(eng)).start()
    ep = lmc.RuntimeEndpoint(srv.url)
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "programs": {}}
    try:
        for name in names:
            prog, kw = workloads()[name]
            comp = prog.compile()
            ways = {"compiled": lambda: comp.run(**kw, backend=ep, temperature=0),
                    "interpreted": lambda: prog.run(**kw, backend=ep, temperature=0)}
            for way, f in ways.items():
                for _ in range(3):
                    f()
                runs = []
                for _ in range(reps):
                    ev.clear()
                    t = time.perf_counter()
                    f()
                    runs.append(summarize(list(ev), (time.perf_counter() - t) * 1e3))
                keep = {k: statistics.median([r[k] for r in runs]) for k, v in runs[0].items()
                        if isinstance(v, (int, float))}
                keep["example_run"] = runs[-1]
                ev.clear()
                t = time.perf_counter()
                f()
                keep["timeline_example"] = [(label, round((a - t) * 1e3, 3), round((b - t) * 1e3, 3), i)
                                            for label, a, b, i in ev]
                busy, wall, kernels = gpu_busy_ms(f)
                keep.update(gpu_busy_ms_profiled_run=busy, profiled_wall_ms=wall, kernels=kernels)
                res["programs"].setdefault(name, {})[way] = keep
                print(name, way, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in keep.items()
                                  if not isinstance(v, (list, dict))}, flush=True)
        if os.environ.get("PROF"):
            profile_chain6(sch, ep)
    finally:
        srv.stop()
        eng.shutdown()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
