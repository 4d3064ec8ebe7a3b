"""Where one compiled program instance's time goes on an lmc server: a timeline of each segment's request, from the
client's POST to the server's parse and checks, the chain's submission, the engine's steps, and the response.

    python benchmarks/program_timeline.py [--model dummy:smollm2-135m@<tokenizer dir>] [--reps 10] --out timeline.json

The server runs in this process (ServerThread, a real socket) so the marks share one clock: they wrap
RuntimeEndpoint.run_programs (the client's request), the /v1/programs route's parse-and-check, Engine.submit_chain
and Scheduler.step. Per program and segment it reports the median milliseconds of each phase and the engine's
steps (how many, against the instance's forwards; busy: inside a step; idle: between steps while it ran).
programs_bench.py times the ways against each other on a separate server process; this says what a compiled
instance's wall time is made of (on a GPU a forward of the embedded model takes about a millisecond, so what is
not a forward bounds the ratio).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..", "tests"), HERE]

from programs_bench import workloads  # noqa: E402
from record import SHARED_MACHINE_NOTE, finish, provenance, spread  # noqa: E402

PHASES = ("to_parse", "parse", "to_submit", "to_first_step", "steps_busy", "steps_idle", "to_response")


def _wrap(owner, name: str, label: str, marks: list, is_async: bool = False) -> None:
    fn = getattr(owner, name)
    if is_async:
        async def wrapped(*a, **k):
            marks.append((label + ">", time.perf_counter()))
            try:
                return await fn(*a, **k)
            finally:
                marks.append((label + "<", time.perf_counter()))
    else:
        def wrapped(*a, **k):
            marks.append((label + ">", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((label + "<", time.perf_counter()))
    setattr(owner, name, wrapped)


def segments(marks: list) -> list[dict]:
    """Each client request's phases (ms) from one instance's marks."""
    out, i = [], 0
    while i < len(marks):
        if marks[i][0] != "post>":
            i += 1
            continue
        j = next(k for k in range(i, len(marks)) if marks[k][0] == "post<")
        seg = marks[i:j + 1]
        at = {n: t for n, t in reversed(seg)}  # the first mark of each name
        steps, opened = [], None  # (a fork's chains are submitted from the server's thread, maybe mid-step)
        for n, t in seg:
            if n == "step>":
                opened = t
            elif n == "step<" and opened is not None:
                steps.append((opened, t))
                opened = None
        last = max(t for n, t in seg if n == "step<")
        first = min(a for a, _ in steps)
        busy = sum(b - a for a, b in steps)
        out.append({"to_parse": at["parse>"] - at["post>"], "parse": at["parse<"] - at["parse>"],
                    "to_submit": at["submit>"] - at["parse<"], "to_first_step": first - at["submit>"],
                    "steps_busy": busy, "steps_idle": last - first - busy, "to_response": seg[-1][1] - last,
                    "steps": len(steps)})
        i = j + 1
    return [{k: v * 1e3 if k != "steps" else v for k, v in s.items()} for s in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--programs", default="chain6,tree_of_thought,judge,react_agent")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prov = provenance("benchmarks/program_timeline.py", SHARED_MACHINE_NOTE)
    import torch

    import lmc
    import lmc.server.programs_api as programs_api
    from lmc.backend.endpoint import RuntimeEndpoint
    from lmc.runtime.engine import Engine
    from lmc.server import ServerThread, create_app

    marks: list = []
    _wrap(RuntimeEndpoint, "run_programs", "post", marks, is_async=True)
    _wrap(programs_api, "_prepare", "parse", marks)
    _wrap(Engine, "submit_chain", "submit", marks)
    eng = Engine(model=args.model, max_total_tokens=65536 if torch.cuda.is_available() else None)
    _wrap(eng.scheduler, "step", "step", marks)
    srv = ServerThread(create_app(eng)).start()
    ep = lmc.RuntimeEndpoint(srv.url)
    res = {"model": args.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "overlap": eng.overlap_schedule, "reps": args.reps, "phases": list(PHASES), "programs": {}}
    try:
        for name in args.programs.split(","):
            prog, kwargs = workloads()[name]
            compiled = prog.compile()
            for _ in range(3):
                compiled.run(**kwargs, backend=ep, temperature=0)
            walls, runs, forwards = [], [], []
            for _ in range(args.reps):
                marks.clear()
                f0, t0 = eng.scheduler.stats["forwards"], time.perf_counter()
                compiled.run(**kwargs, backend=ep, temperature=0)
                walls.append((time.perf_counter() - t0) * 1e3)
                forwards.append(eng.scheduler.stats["forwards"] - f0)
                runs.append(segments(list(marks)))
            if len({len(r) for r in runs}) > 1:
                raise SystemExit(f"{name}: its instances made different numbers of requests ({[len(r) for r in runs]})")
            segs = [{k: spread([r[s][k] for r in runs]) for k in (*PHASES, "steps")} for s in range(len(runs[0]))]
            # the client's own share: the program's host code between segments, its tracing and planning
            client = [w - sum(sum(x[k] for k in PHASES) for x in r) for w, r in zip(walls, runs)]
            res["programs"][name] = {"wall_ms": spread(walls), "segments": segs, "outside_requests_ms": spread(client),
                                     "forwards": spread(forwards)}
            phases = [", ".join(f"{k} {s[k]['median']:.2f}" for k in PHASES) + f", {s['steps']['median']:.0f} steps"
                      for s in segs]
            print(name, f"wall {statistics.median(walls):.2f} ms, outside requests {statistics.median(client):.2f};",
                  " | ".join(phases), flush=True)
    finally:
        srv.stop()
        eng.shutdown()
    res["provenance"] = finish(prov)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
