"""Interpreter overhead: run_batch of 200 few-shot programs vs the same prompts submitted straight to the engine,
on the embedded model (CPU). Runs each side --repeat times, alternating, and records the median, min and max.

    python benchmarks/frontend_overhead.py [--programs 200] [--repeat 5] [--out benchmarks/results/frontend_overhead.json]
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

from record import SHARED_MACHINE_NOTE, finish, provenance, spread  # noqa: E402

SHOTS = [("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"),
         ("Norway", "Oslo"), ("Chile", "Santiago"), ("Greece", "Athens")]
COUNTRIES = ["France", "Spain", "Germany", "Canada", "Brazil", "India", "China", "Mexico", "Poland", "Cuba"]
FEW_SHOT = "".join(f"Question: What is the capital of {c}?\nAnswer: {a}\n\n" for c, a in SHOTS)
NEW = 8


@lmc.function
def few_shot(s, question):
    s += FEW_SHOT + "Question: " + question + "\nAnswer:"
    s += lmc.gen("answer", max_tokens=NEW, stop="\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5, help="runs of each side, alternating (default 5)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "frontend_overhead.json"))
    args = ap.parse_args()
    if args.repeat < 1 or args.programs < 1:
        ap.error("--repeat and --programs must be at least 1")
    prov = provenance("benchmarks/frontend_overhead.py", SHARED_MACHINE_NOTE)
    backend = lmc.Local()
    engine = backend.engine
    questions = [f"What is the capital of {COUNTRIES[i % len(COUNTRIES)]}? (#{i})" for i in range(args.programs)]
    prompts = [FEW_SHOT + "Question: " + q + "\nAnswer:" for q in questions]
    params = {"max_new_tokens": NEW, "stop": "\n", "temperature": 0}

    def direct():
        engine.flush_cache()
        t = time.perf_counter()
        out = engine.generate(prompts, params)
        return time.perf_counter() - t, [o["text"] for o in out]

    def programs():
        engine.flush_cache()
        t = time.perf_counter()
        states = few_shot.run_batch([{"question": q} for q in questions], backend=backend, temperature=0,
                                    progress_bar=True)
        return time.perf_counter() - t, [s["answer"] for s in states]

    direct()  # warm-up
    runs: dict[str, list[float]] = {"direct": [], "run_batch": []}
    texts: dict[str, list[str]] = {}
    same = True
    for _ in range(args.repeat):
        for name, fn in (("direct", direct), ("run_batch", programs)):
            secs, texts[name] = fn()
            runs[name].append(secs)
        same &= texts["direct"] == texts["run_batch"]
    n = args.programs
    res = {"programs": n, "shots": len(SHOTS), "max_new_tokens": NEW,
           "direct_programs_s": spread([n / t for t in runs["direct"]]),
           "run_batch_programs_s": spread([n / t for t in runs["run_batch"]]),
           # per repetition: the two sides ran back to back, so their ratio shares the machine's load
           "ratio": spread([d / b for d, b in zip(runs["direct"], runs["run_batch"])]),
           "same_outputs": same, "provenance": finish(prov)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"medians of {args.repeat}: direct {res['direct_programs_s']['median']:.2f} programs/s, run_batch "
          f"{res['run_batch_programs_s']['median']:.2f} programs/s, ratio {res['ratio']['median']:.2f} "
          f"(target >= 0.8), same outputs: {same}")
    backend.shutdown()


if __name__ == "__main__":
    main()
