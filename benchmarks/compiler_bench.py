"""Compiled vs interpreted: the example programs themselves (examples/), run_batch of N instances each, on the
embedded model.

For every example the two modes alternate (interpreted, compiled, interpreted, ...) R times each, the radix
cache flushed before every run; reported per mode: the median and min-max of programs/s, and the median prefill
tokens (prompt tokens not served by the cache) and engine forwards, which are exact counts. The interpreted side
is the interpreter as a user runs it (`prog.run_batch`); the compiled side is `prog.compile()` once per example,
warmed by one batch (its tracing and segment cache are then what a user's second batch sees), run with the same
`run_batch`. Every run checks that both modes give the same variables (temperature 0).

    python benchmarks/compiler_bench.py [--n 32] [--repeat 5] [--only judge,react_agent] [--out PATH]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lmc  # noqa: E402

COUNTRIES = ["France", "Spain", "Germany", "Canada", "Brazil", "India", "China", "Mexico", "Poland", "Cuba",
             "Japan", "Kenya", "Egypt", "Peru", "Chile", "Italy"]
TOPICS = ["sleep", "cooking", "running", "reading", "saving money", "learning a language", "gardening", "travel"]


def instances(name: str, n: int) -> list[dict]:
    """N argument sets per example (distinct, so instances share only what the program shares)."""
    c = [COUNTRIES[i % len(COUNTRIES)] for i in range(n)]
    return [{
        "few_shot_qa": lambda i: {"question": f"What is the capital of {c[i]}?"},
        "tree_of_thought": lambda i: {"question": f"What is {i} + {2 * i + 3}?"},
        "judge": lambda i: {"question": f"What is the capital of {c[i]}?", "answer": f"It is {c[(i + 3) % n]}."},
        "react_agent": lambda i: {"question": f"What is the population of the capital of {c[i]}?"},
        "tip_suggestion": lambda i: {"topic": f"{TOPICS[i % len(TOPICS)]} (#{i})"},
        "calculator_agent": lambda i: {"question": f"What is {i + 2} times {i + 7}, plus {i}?"},
        "counted_list": lambda i: {"topic": f"{TOPICS[i % len(TOPICS)]} ideas"},
    }[name](i) for i in range(n)]


EXAMPLES = ["tree_of_thought", "judge", "react_agent", "tip_suggestion", "few_shot_qa", "calculator_agent",
            "counted_list"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    [prog] = [v for v in vars(mod).values() if isinstance(v, lmc.Program) and v.func.__module__ == mod.__name__]
    return prog


def measure(backend, run) -> dict:
    engine = backend.engine
    engine.flush_cache()
    s0 = dict(engine.stats())
    t = time.perf_counter()
    states = run()
    secs = time.perf_counter() - t
    s1 = engine.stats()
    errors = [st.error() for st in states if st.error() is not None]
    if errors:
        raise errors[0]
    prefill = (s1["prompt_tokens"] - s0["prompt_tokens"]) - (s1["cached_tokens"] - s0["cached_tokens"])
    return {"programs_s": len(states) / secs, "prefill_tokens": prefill, "forwards": s1["forwards"] - s0["forwards"],
            "variables": [st.variables() for st in states], "text": [st.text() for st in states]}


def summary(runs: list[dict]) -> dict:
    rates = [r["programs_s"] for r in runs]
    return {"programs_s_median": statistics.median(rates), "programs_s_min": min(rates), "programs_s_max": max(rates),
            "programs_s_runs": [round(x, 3) for x in rates],
            "prefill_tokens_median": statistics.median(r["prefill_tokens"] for r in runs),
            "forwards_median": statistics.median(r["forwards"] for r in runs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32, help="instances per run_batch")
    ap.add_argument("--repeat", type=int, default=5, help="runs per mode (alternating)")
    ap.add_argument("--only", default=None, help="comma-separated examples (default: all seven)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--note", default="", help="added to the JSON (e.g. how busy the machine was)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "compiler_examples.json"))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else EXAMPLES
    backend = lmc.Local(device=args.device)
    results = {"config": {"n": args.n, "repeat": args.repeat, "device": str(backend.engine.runner.device),
                          "machine": platform.node(), "cpus": os.cpu_count(), "note": args.note}, "examples": {}}
    for name in names:
        prog, items = load(name), instances(name, args.n)
        compiled = prog.compile()
        prog.run_batch(items[:2], backend=backend, temperature=0)  # warm-up (and the compiled program's traces)
        compiled.run_batch(items, backend=backend, temperature=0)
        modes = {"interpreted": lambda: prog.run_batch(items, backend=backend, temperature=0),
                 "compiled": lambda: compiled.run_batch(items, backend=backend, temperature=0)}
        runs = {m: [] for m in modes}
        same = True
        for _ in range(args.repeat):
            for mode, run in modes.items():  # alternating, so drift in the machine's load hits both
                runs[mode].append(measure(backend, run))
            same &= runs["compiled"][-1]["variables"] == runs["interpreted"][-1]["variables"] and \
                runs["compiled"][-1]["text"] == runs["interpreted"][-1]["text"]
        row = {m: summary(r) for m, r in runs.items()}
        row["speedup_median"] = row["compiled"]["programs_s_median"] / row["interpreted"]["programs_s_median"]
        row["same_variables_and_text"] = same
        row["segments"] = dict(compiled.stats)
        results["examples"][name] = row
        print(f"{name:17s} interpreted {row['interpreted']['programs_s_median']:7.2f} "
              f"[{row['interpreted']['programs_s_min']:.2f}-{row['interpreted']['programs_s_max']:.2f}]  compiled "
              f"{row['compiled']['programs_s_median']:7.2f} [{row['compiled']['programs_s_min']:.2f}-"
              f"{row['compiled']['programs_s_max']:.2f}] programs/s  x{row['speedup_median']:.2f}  prefill "
              f"{row['interpreted']['prefill_tokens_median']:.0f} -> {row['compiled']['prefill_tokens_median']:.0f}"
              f"  forwards {row['interpreted']['forwards_median']:.0f} -> {row['compiled']['forwards_median']:.0f}"
              f"  same={same}", flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:  # after every example: a long run stopped early keeps what it measured
            json.dump(results, f, indent=2)
    backend.shutdown()


if __name__ == "__main__":
    main()
