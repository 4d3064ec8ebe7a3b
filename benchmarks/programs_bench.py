"""Latency of one program instance through `lmc serve`: the compiled program over POST /v1/programs (one request
per segment; the server runs each run of calls between host breaks as one engine request, engine-side
continuation) against the interpreted program over RuntimeEndpoint (one request per gen and select), and, as the
ablation, the compiled program on a second server started with --disable-continuation (one engine request per
call, next to the engine).

    flock /tmp/lmc-bench.lock python benchmarks/programs_bench.py [--reps 5] [--out benchmarks/results/programs_latency.json]

Programs: a chain of 6 short gens and selects and the example tree_of_thought (static: no graph break; its host
code, scores from the selects' logprobs and the best branch, traces into expressions since session 26), and the
examples judge and react_agent (with graph breaks: host code between segments). One instance at a time, temperature 0; the ways
alternate within each repetition (their order rotating), after one warm-up run of each (the servers' prefix
caches are warm for every way: each run repeats the same prompts, as a deployed program's instances share their
constant prefixes). Also recorded: the HTTP requests one instance makes each way (a static instance must make
exactly one), and whether every way gives the same variables.
Targets (issue 14): compiled/interpreted <= 0.6 on the chain, <= 0.8 on the others.

`--model dummy:tiny@smollm2-135m-instruct` (a 2-layer model with the real tokenizer, random weights) makes a forward
cost next to nothing: the times are then what is not a forward (HTTP, admission, tokenization, the plan's
execution, the scheduler), the share that bounds the ratio on a GPU, where a forward of the embedded model takes a
millisecond or two.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the chain program and the request counter live there
sys.path.insert(0, HERE)

from programs_support import CountedEndpoint, chain  # noqa: E402
from record import SHARED_MACHINE_NOTE, exact, finish, jsonable, provenance, spread  # noqa: E402
from serving_bench import LmcServer  # noqa: E402

MODEL = "smollm2-135m-instruct"


def workloads():
    from judge import judge
    from react_agent import react_agent
    from tree_of_thought import tree_of_thought

    return {"chain6": (chain, {"topic": "the moon"}),
            "tree_of_thought": (tree_of_thought, {"question": "What is 2 + 3?"}),
            "judge": (judge, {"question": "What is the capital of France?", "answer": "Paris."}),
            "react_agent": (react_agent, {"question": "What is the capital of Italy?"})}


GPU_KV_TOKENS = 262_144

TARGETS = {"chain6": 0.6, "tree_of_thought": 0.8, "judge": 0.8, "react_agent": 0.8}


ENGINE_COUNTS = ("forwards", "prefill_forwards", "decode_forwards", "computed_tokens", "fused_selects",
                 "forked_branches")


def engine_counts(ep) -> dict:
    st = ep.get_server_info()["internal_states"][0]
    return {k: st[k] for k in ENGINE_COUNTS}


def one(prog, args, ep, compiled) -> tuple[float, int, dict, dict]:
    """(seconds, HTTP requests, variables, the server's engine counters over the run) of one instance."""
    counts = engine_counts(ep)
    before = CountedEndpoint.requests
    t0 = time.perf_counter()
    state = (compiled.run if compiled is not None else prog.run)(**args, backend=ep, temperature=0)
    dt = time.perf_counter() - t0
    n = CountedEndpoint.requests - before
    after = engine_counts(ep)
    return dt, n, {k: jsonable(v) for k, v in state.variables().items()}, {k: after[k] - counts[k] for k in counts}


WAYS = ("interpreted", "compiled", "compiled_no_continuation")


def differences(outs: dict) -> list[dict]:
    """Every variable of a run whose value differs from the first interpreted run's: (way, repetition, name, the
    two values). Empty when every way gave the same variables."""
    ref = outs["interpreted"][0]
    return [{"way": w, "rep": i, "variable": k, "interpreted": ref.get(k), "got": v}
            for w in WAYS for i, o in enumerate(outs[w]) for k, v in o.items() if ref.get(k) != v]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "programs_latency.json"))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--model", default=MODEL, help="what the servers serve (default: the embedded model)")
    a = ap.parse_args()
    prov = provenance("benchmarks/programs_bench.py", SHARED_MACHINE_NOTE)
    logs = [os.path.join(tempfile.gettempdir(), f"programs_bench_{w}.log") for w in ("on", "off")]
    import torch

    # Two servers share one GPU: each sizes its KV pool to GPU_KV_TOKENS instead of 85% of the device's memory
    # (the second would find none left). The CPU's default pool is already small.
    common = ("--log-level", "warning") + (("--max-total-tokens", str(GPU_KV_TOKENS))
                                            if torch.cuda.is_available() else ())
    servers = [LmcServer(logs[0], common, a.model),
               LmcServer(logs[1], (*common, "--disable-continuation"), a.model)]
    results = {}
    try:
        for srv in servers:
            srv.start()
        on, off = (CountedEndpoint(srv.base_url[:-len("/v1")]) for srv in servers)
        for name, (prog, args) in workloads().items():
            if a.only and name not in a.only:
                continue
            compiled = prog.compile()
            runs = {"interpreted": (on, None), "compiled": (on, compiled), "compiled_no_continuation": (off, compiled)}
            for ep, c in runs.values():  # warm-up of every way: prefix cache, traces, connections
                one(prog, args, ep, c)
            times = {w: [] for w in WAYS}
            reqs = {w: [] for w in WAYS}
            outs = {w: [] for w in WAYS}
            engine = {w: {k: [] for k in ENGINE_COUNTS} for w in WAYS}
            for rep in range(a.reps):
                for way in WAYS[rep % 3:] + WAYS[:rep % 3]:  # alternating, in a rotating order
                    dt, n, out, counts = one(prog, args, *runs[way])
                    times[way].append(dt)
                    reqs[way].append(n)
                    outs[way].append(out)
                    for k, v in counts.items():
                        engine[way][k].append(v)
            ratio = [c / i for c, i in zip(times["compiled"], times["interpreted"])]
            ablation = [c / i for c, i in zip(times["compiled"], times["compiled_no_continuation"])]
            forwards = [c / i for c, i in zip(engine["compiled"]["forwards"], engine["interpreted"]["forwards"])]
            results[name] = {
                "interpreted_s": spread(times["interpreted"]), "compiled_s": spread(times["compiled"]),
                "compiled_no_continuation_s": spread(times["compiled_no_continuation"]),
                "ratio": spread(ratio), "target_ratio": TARGETS[name],
                "continuation_ratio": spread(ablation), "forwards_ratio": spread(forwards),
                "requests_interpreted": exact(reqs["interpreted"]), "requests_compiled": exact(reqs["compiled"]),
                "requests_compiled_no_continuation": exact(reqs["compiled_no_continuation"]),
                "same_variables": all(o == outs["interpreted"][0] for w in WAYS for o in outs[w]),
                "differences": differences(outs),
                "engine": {w: {k: spread(v) for k, v in engine[w].items()} for w in WAYS}}
            if not prog.compile().breaks()[1]:  # a static instance: exactly one HTTP request, every run
                results[name]["static_one_request"] = all(n == 1 for n in reqs["compiled"])
            print(name, "ratio", json.dumps(results[name]["ratio"]), "forwards", json.dumps(forwards),
                  "continuation", json.dumps(results[name]["continuation_ratio"]), "requests", reqs, "same:",
                  results[name]["same_variables"], flush=True)
        on.shutdown()
        off.shutdown()
    finally:
        for srv in servers:
            srv.stop()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # the servers' (both: auto)
    out = {"provenance": finish(prov), "model": a.model, "device": device, "reps": a.reps, "workloads": results,
           "note": "ratio = compiled over /v1/programs / interpreted over RuntimeEndpoint, per repetition; "
                   "continuation_ratio = compiled / compiled on a server with --disable-continuation; one instance "
                   "at a time, temperature 0; lmc serve on `device` (bf16 on a GPU). engine: the server's forwards and "
                   "computed tokens per instance, each way: decode steps are the same every way (the calls' "
                   "outputs), so they bound how far below 1 the ratio can go: forwards_ratio = compiled / "
                   "interpreted engine forwards per repetition, the time ratio if every forward cost the same and "
                   "nothing else took time; fused_selects: selects fused with the gen after them (since commit "
                   "58f5159 also a select scored by ids followed by a greedy gen, where the forward stays small: "
                   "latency fusion, one forward fewer per select). "
                   "Since commit 8c35d02 the server's connections have TCP_NODELAY: "
                   "before, every request on a kept-alive connection waited ~40 ms for a delayed ACK, which the "
                   "interpreted way paid once per call (earlier recordings include it). ratio compares two ways on "
                   "ONE server; "
                   "continuation_ratio compares two server processes, whose speed per forward differs with the "
                   "machine's load (see each way's forwards for what continuation saves)"}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
