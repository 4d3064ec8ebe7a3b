"""Compiled vs interpreted programs on the embedded model (CPU), and the ablation of each optimisation.

Workloads: a few-shot batch, tree-of-thought (3 branches, each scored with select) and a 3-dimension judge
(fork/join). Both modes run the same programs on one engine; the radix cache is flushed before each run.
Reports programs/s and prompt tokens that had to be prefilled (prompt - cached).

    python benchmarks/compiler_bench.py [--n 24] [--repeat 3] [--out benchmarks/results/compiler.json]

With --repeat R every configuration runs R times and the median programs/s is reported (the CPU is shared: one
run can be off by 20%).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lmc  # noqa: E402

SHOTS = "".join(f"Q: What is the capital of {c}?\nA: {a}\n\n" for c, a in
                [("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi")])
COUNTRIES = ["France", "Spain", "Germany", "Canada", "Brazil", "India", "China", "Mexico", "Poland", "Cuba"]
APPROACHES = ["Let's think step by step.", "Let's start from what we know.", "Let's compare the options."]
DIMENSIONS = ["clarity", "accuracy", "relevance"]


@lmc.function
def few_shot(s, question):
    s += SHOTS + "Q: " + question + "\nA:" + lmc.gen("answer", max_tokens=6, stop="\n")


@lmc.function
def tree_of_thought(s, question):
    s += lmc.system("You are a careful problem solver.") + lmc.user(question)
    forks = s.fork(3)
    for approach, f in zip(APPROACHES, forks):
        f += lmc.assistant(approach + lmc.gen("thought", max_tokens=16, stop="\n\n"))
        f += lmc.user("Is the reasoning above correct? Answer yes or no.")
        f += lmc.assistant(lmc.select("correct", choices=["yes", "no"]))
    forks.join()
    s += lmc.user("Give the final answer in one sentence.") + lmc.assistant(lmc.gen("answer", max_tokens=12))


@lmc.function
def judge(s, question, answer):
    s += lmc.system("You are a strict judge of answers.")
    s += lmc.user_begin() + "Question: " + question + "\nAnswer: " + answer + "\n\n"
    forks = s.fork(len(DIMENSIONS))
    for dim, f in zip(DIMENSIONS, forks):
        f += f"Rate the answer's {dim} from 1 to 5." + lmc.user_end()
        f += lmc.assistant(lmc.select("score", choices=["1", "2", "3", "4", "5"]) + " because"
                           + lmc.gen("reason", max_tokens=12, stop="\n"))
    forks.join()
    s += "Is the answer good overall?" + lmc.user_end() + lmc.assistant(lmc.select("verdict", choices=["yes", "no"]))


def workloads(n: int):
    qs = [f"What is the capital of {COUNTRIES[i % len(COUNTRIES)]}? (#{i})" for i in range(n)]
    return {
        "few_shot": (few_shot, [{"question": q} for q in qs] * 2),
        "tree_of_thought": (tree_of_thought, [{"question": f"What is {i} + {2 * i}?"} for i in range(n)]),
        "judge": (judge, [{"question": q, "answer": COUNTRIES[i % len(COUNTRIES)]} for i, q in enumerate(qs)]),
    }


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
    return {"programs_s": len(states) / secs, "seconds": secs, "prefill_tokens": prefill,
            "forwards": s1["forwards"] - s0["forwards"], "variables": [st.variables() for st in states]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "compiler.json"))
    args = ap.parse_args()
    backend = lmc.Local()
    sched = backend.engine.scheduler
    results = {}
    for name, (prog, items) in workloads(args.n).items():
        prog.run_batch(items[:2], backend=backend, temperature=0)  # warm-up
        row = {}

        def interp():
            return prog.run_batch(items, backend=backend, temperature=0)

        def compiled(**opts):
            return lambda: prog.compile(**opts).run_batch(items, backend=backend, temperature=0)

        configs = [("interpreted", interp, {}), ("compiled", compiled(), {}),
                   ("no hint", compiled(fork_commit=False), {}), ("no fork batching", compiled(fork_batch=False), {}),
                   ("no select lowering", compiled(select_lowering=False), {}),
                   ("no hoisting", compiled(hoist="off"), {}),
                   ("FCFS", compiled(), {"policy": "fcfs"}), ("radix cache off", compiled(), {"no_cache": True})]
        for label, run, env in configs:
            sched.cfg.policy = env.get("policy", "lpm")
            sched.cache.disabled = env.get("no_cache", False)
            runs = sorted((measure(backend, run) for _ in range(args.repeat)), key=lambda r: r["programs_s"])
            row[label] = runs[len(runs) // 2]
            row[label]["programs_s_runs"] = [round(r["programs_s"], 3) for r in runs]
            print(f"{name:16s} {label:18s} {row[label]['programs_s']:7.2f} programs/s  "
                  f"prefill {row[label]['prefill_tokens']:6d} tokens  forwards {row[label]['forwards']}", flush=True)
        sched.cfg.policy, sched.cache.disabled = "lpm", False
        same = row["compiled"]["variables"] == row["interpreted"]["variables"]
        for r in row.values():
            r.pop("variables")
        row["same_variables"] = same
        row["speedup"] = row["compiled"]["programs_s"] / row["interpreted"]["programs_s"]
        results[name] = row
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print("\nworkload          compiled/interpreted  same variables")
    for name, row in results.items():
        print(f"{name:16s}  {row['speedup']:6.2f}x              {row['same_variables']}")
    backend.shutdown()


if __name__ == "__main__":
    main()
