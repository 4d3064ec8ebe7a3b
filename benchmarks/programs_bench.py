"""Latency of one program instance through `lmc serve`: the compiled program over POST /v1/programs (one request
per segment) against the interpreted program over RuntimeEndpoint (one or more requests per gen/select).

    flock /tmp/lmc-bench.lock python benchmarks/programs_bench.py [--reps 3] [--out benchmarks/results/programs_latency.json]

Programs: a chain of 6 short gens and selects (static), and the examples tree_of_thought, judge and react_agent
(each with graph breaks: host code between segments). One instance at a time, temperature 0; the two ways
alternate within each repetition, after one warm-up run of each (the server's prefix cache is warm for both:
each run repeats the same prompts, as a deployed program's instances share their constant prefixes). Also
recorded: the HTTP requests one instance makes each way, and whether the two ways give the same variables.
Targets (issue 14): compiled/interpreted <= 0.6 on the chain, <= 0.8 on the others.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

import lmc  # noqa: E402
from lmc.backend.endpoint import RuntimeEndpoint, _httpx  # noqa: E402
from record import SHARED_MACHINE_NOTE, finish, provenance, spread  # noqa: E402

MODEL = "smollm2-135m-instruct"


@lmc.function
def chain(s, topic):
    """6 short calls in a row: gen, select, gen, select, gen, select."""
    s += "Topic: " + topic + "\n"
    for i in range(3):
        s += f"Fact {i + 1}:" + lmc.gen(f"fact{i}", max_tokens=6, stop="\n") + "\n"
        s += "Is it true? " + lmc.select(f"true{i}", choices=["yes", "no"]) + "\n"


def workloads():
    from judge import judge
    from react_agent import react_agent
    from tree_of_thought import tree_of_thought

    return {"chain6": (chain, {"topic": "the moon"}),
            "tree_of_thought": (tree_of_thought, {"question": "What is 2 + 3?"}),
            "judge": (judge, {"question": "What is the capital of France?", "answer": "Paris."}),
            "react_agent": (react_agent, {"question": "What is the capital of Italy?"})}


TARGETS = {"chain6": 0.6, "tree_of_thought": 0.8, "judge": 0.8, "react_agent": 0.8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.path.join(HERE, "..")}
    proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", "serve", "--model", MODEL, "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
    httpx = _httpx()

    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmc serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError("lmc serve did not come up")


class CountedEndpoint(RuntimeEndpoint):
    """RuntimeEndpoint counting the HTTP requests it sends (the benchmark's instrument)."""

    requests = 0

    def _client(self):
        c = super()._client()
        if not getattr(c, "_counted", False):
            async def count(request):
                type(self).requests += 1
            c.event_hooks = {"request": [count], "response": []}
            c._counted = True
        return c


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)


def one(prog, args, ep, compiled) -> tuple[float, int, dict]:
    before = CountedEndpoint.requests
    t0 = time.perf_counter()
    state = (compiled.run if compiled is not None else prog.run)(**args, backend=ep, temperature=0)
    dt = time.perf_counter() - t0
    return dt, CountedEndpoint.requests - before, {k: _jsonable(v) for k, v in state.variables().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "programs_latency.json"))
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    prov = provenance("benchmarks/programs_bench.py", SHARED_MACHINE_NOTE)
    port = _free_port()
    proc = start_server(port)
    results = {}
    try:
        ep = CountedEndpoint(f"http://127.0.0.1:{port}")
        for name, (prog, args) in workloads().items():
            if a.only and name not in a.only:
                continue
            compiled = prog.compile()
            one(prog, args, ep, None)  # warm-up of both ways: prefix cache, traces, connections
            one(prog, args, ep, compiled)
            times = {"interpreted": [], "compiled": []}
            reqs = {"interpreted": [], "compiled": []}
            outs = {}
            for _ in range(a.reps):
                for way, c in (("interpreted", None), ("compiled", compiled)):
                    dt, n, out = one(prog, args, ep, c)
                    times[way].append(dt)
                    reqs[way].append(n)
                    outs[way] = out
            ratios = [c / i for c, i in zip(times["compiled"], times["interpreted"])]
            results[name] = {"interpreted_s": spread(times["interpreted"]), "compiled_s": spread(times["compiled"]),
                             "ratio": spread(ratios), "target_ratio": TARGETS[name],
                             "requests_interpreted": spread(reqs["interpreted"]),
                             "requests_compiled": spread(reqs["compiled"]),
                             "same_variables": outs["interpreted"] == outs["compiled"]}
            print(name, json.dumps(results[name]["ratio"]), "requests", reqs, "same:",
                  results[name]["same_variables"], flush=True)
        ep.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = {"provenance": finish(prov), "model": MODEL, "reps": a.reps, "workloads": results,
           "note": "ratio = compiled over /v1/programs / interpreted over RuntimeEndpoint, per repetition; "
                   "one instance at a time, temperature 0; lmc serve on this machine's CPU"}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
