"""GPU time per forward by kind, compiled vs interpreted: the examples of compiler_bench.py as run_batch of 32 on
the embedded model, each forward timed by CUDA events around ModelRunner._forward and counted as `graph` (a
replayed decode graph), `extend` (an eager prefill), `mixed` (an eager prefill in which the running requests
decode too: a chain's next text, a jump-forward) or `decode_eager`; `launch_ms` is the host's time in the call.
An eager forward's GPU time is its launches' (the GPU waits on the host), which is why compiled programs whose
chains extended one at a time were slower than interpreted on the H200 (results/h200_probe/README.md).

With --chunks-ab, each mode runs twice per repetition, alternating: extends longer than the largest graph bucket
replayed in chunks (cuda_graph.py, the default) and the same forwards eager (`/no_chunks`: the rule before it).

    python benchmarks/gpu_forward_probe.py [--examples counted_list,react_agent] [--reps 2] [--model M]
                                           [--chunks-ab] [--out PATH]
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import compiler_bench as cb  # noqa: E402  (sets up the import path and HF_HUB_OFFLINE)
import lmc  # noqa: E402
import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", default="counted_list,react_agent,tree_of_thought")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="e.g. dummy:smollm2-135m@<tokenizer dir>")
    ap.add_argument("--chunks-ab", action="store_true", help="also run every mode with chunked extends off")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fwd_probe.json"))
    args = ap.parse_args()
    backend = lmc.Local(args.model, device="cuda")
    runner, forwards = backend.engine.runner, []
    real = runner._forward
    graphs = runner.graphs
    chunked = graphs.replays_extend

    def set_chunks(on: bool) -> None:
        graphs.replays_extend = chunked if on else lambda n, seq: n <= graphs.extend_max and chunked(n, seq)

    def timed(host, sizes, shape):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        out = real(host, sizes, shape)
        end.record()
        graph = shape[0] and runner.graphs is not None and sizes[0] <= runner.graphs.max_bs
        extend_graph = not shape[0] and runner.graphs is not None and runner.graphs.replays_extend(shape[3], shape[2])
        kind = ("graph" if graph else "decode_eager" if shape[0] else "extend_graph" if extend_graph
                else "mixed" if sizes[7] else "extend")
        forwards.append((kind, shape[3], (time.perf_counter() - t) * 1e3, start, end))
        return out

    runner._forward = timed
    results = {}
    for name in args.examples.split(","):
        prog, items = cb.load(name), cb.instances(name, 32)
        compiled = prog.compile()
        prog.run_batch(items, backend=backend, temperature=0)  # warm-up of both modes
        compiled.run_batch(items, backend=backend, temperature=0)
        modes = {"interpreted": lambda: prog.run_batch(items, backend=backend, temperature=0),
                 "compiled": lambda: compiled.run_batch(items, backend=backend, temperature=0)}
        if args.chunks_ab:
            modes = {f"{m}{suffix}": (lambda run=run, on=not suffix: set_chunks(on) or run())
                     for m, run in modes.items() for suffix in ("", "/no_chunks")}
        for rep in range(args.reps):
            for mode, run in list(modes.items())[::1 if rep % 2 == 0 else -1]:
                backend.engine.flush_cache()
                forwards.clear()
                torch.cuda.synchronize()
                t = time.perf_counter()
                states = run()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t) * 1e3
                kinds = collections.defaultdict(lambda: {"n": 0, "gpu_ms": 0.0, "tokens": 0, "launch_ms": 0.0})
                for kind, tokens, launch_ms, start, end in forwards:
                    k = kinds[kind]
                    k["n"] += 1
                    k["gpu_ms"] += start.elapsed_time(end)
                    k["tokens"] += tokens
                    k["launch_ms"] += launch_ms
                row = {"wall_ms": wall, "gpu_ms": sum(k["gpu_ms"] for k in kinds.values()),
                       "forwards": len(forwards), "by_kind": dict(kinds),
                       "variables": hashlib.sha256(repr([st.variables() for st in states]).encode()).hexdigest()[:12]}
                print(name, mode, rep, json.dumps(row), flush=True)
                results.setdefault(name, {}).setdefault(mode, []).append(row)
        for mode, rows in results[name].items():
            walls = sorted(r["wall_ms"] for r in rows)
            print(f"{name} {mode}: wall median {walls[len(walls) // 2]:.0f} ms {[round(w) for w in walls]}, "
                  f"variables {sorted({r['variables'] for r in rows})}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    backend.shutdown()


if __name__ == "__main__":
    main()
