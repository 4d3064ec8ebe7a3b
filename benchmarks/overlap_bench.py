"""Overlap scheduling on and off, on this machine's device (the CPU here): does processing step N while step N+1
runs pay?

Two engines (the embedded SmolLM2-135M-Instruct, default settings otherwise), `overlap_schedule` True and False,
alternated within every repetition. Measures:
- decode tok/s at batch 1 and 16 (64-token random prompts, ignore_eos): batch / the median wall time of a
  scheduler step in steady decode (a step launches one decode forward and, with overlap, processes the previous
  one; its wall time is the time per generated token). A median of steps, because other processes on this shared
  machine stall single steps;
- no_sharing: 48 unrelated 200-token prompts, 16 generated each: wall seconds of the generate call;
- stops: 16 chat prompts with stop strings and a regex-constrained request mixed in (host work per step grows:
  stop checks, grammar masks, jump-forward): wall seconds.
Each figure is the median of --reps repetitions with min and max (record.spread). Also checks, every repetition,
that both engines returned the same greedy outputs. JSON: benchmarks/results/overlap.json.

    flock /tmp/lmc-bench.lock python benchmarks/overlap_bench.py [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from lmc.runtime import Engine  # noqa: E402
from record import SHARED_MACHINE_NOTE, finish, provenance, spread  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "overlap.json")
CONFIGS = {"overlap": True, "no_overlap": False}


def decode_step_s(eng: Engine, batch: int, new: int, seed: int) -> tuple[float, list]:
    """Median wall time of the scheduler steps that launched a decode forward after a decode forward."""
    prompts = torch.randint(100, 40000, (batch, 64), generator=torch.Generator().manual_seed(seed)).tolist()
    sched, runner, kinds, steps = eng.scheduler, eng.runner, [], []

    def timed_launch(sb):
        kinds.append(sb.is_decode)
        return launch(sb)

    def timed_step():
        t0, n = time.perf_counter(), len(kinds)
        out = step()
        if len(kinds) > n and kinds[-1] and len(kinds) > 1 and kinds[-2]:
            steps.append(time.perf_counter() - t0)
        return out

    launch, step = runner.launch, sched.step
    runner.launch, sched.step = timed_launch, timed_step  # instance attributes: wrapped for this call only
    try:
        eng.flush_cache()
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0,
                                                                "ignore_eos": True})
    finally:
        del runner.launch, sched.step
    return statistics.median(steps), [o["output_ids"] for o in outs]


def wall_s(eng: Engine, prompts, params) -> tuple[float, list]:
    eng.flush_cache()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - t0, [o["output_ids"] for o in outs]


def workloads(tokenizer, seed: int):
    g = torch.Generator().manual_seed(seed)
    unrelated = torch.randint(100, 40000, (48, 200), generator=g).tolist()
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    topics = ["rivers", "bridges", "owls", "volcanoes", "tea", "chess", "maps", "clocks"]
    chat = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write two short lines about {t}."}], add_generation_prompt=True, tokenize=False))
        for t in topics * 2]
    stops = [{"max_new_tokens": 48, "temperature": 0, "stop": ["\n\n", "."]} for _ in chat]
    stops[3] = {"max_new_tokens": 48, "temperature": 0, "regex": r'\{"name": "[a-z]{1,8}", "age": [0-9]{1,2}\}'}
    return (unrelated, greedy), (chat, stops)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-new", type=int, default=32)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    prov = provenance("benchmarks/overlap_bench.py", SHARED_MACHINE_NOTE)
    engines = {name: Engine(overlap_schedule=flag, max_total_tokens=16384) for name, flag in CONFIGS.items()}
    for eng in engines.values():  # warm-up: first-touch of KV pages and allocator
        decode_step_s(eng, 16, 4, seed=99)
    runs: dict = {n: {"decode_b1_tok_s": [], "decode_b16_tok_s": [], "no_sharing_s": [], "stops_s": []}
                  for n in engines}
    same = []
    for rep in range(args.reps):
        (unrelated, greedy), (chat, stops) = workloads(engines["overlap"].tokenizer, rep)
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))  # alternate who goes first
        outs: dict = {n: [] for n in engines}
        for name in order:
            eng, r = engines[name], runs[name]
            for batch, key in ((1, "decode_b1_tok_s"), (16, "decode_b16_tok_s")):
                s, o = decode_step_s(eng, batch, args.decode_new, seed=rep)
                r[key].append(batch / s)
                outs[name].append(o)
            for key, (prompts, params) in (("no_sharing_s", (unrelated, greedy)), ("stops_s", (chat, stops))):
                s, o = wall_s(eng, prompts, params)
                r[key].append(s)
                outs[name].append(o)
            print(f"rep {rep} {name}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in r.items()), flush=True)
        same.append(outs["overlap"] == outs["no_overlap"])
    for eng in engines.values():
        eng.shutdown()
    results = {n: {k: spread(v) for k, v in r.items()} for n, r in runs.items()}
    ratio = {k: spread([a / b if k.endswith("tok_s") else b / a
                        for a, b in zip(runs["overlap"][k], runs["no_overlap"][k])]) for k in runs["overlap"]}
    out = {"model": "smollm2-135m-instruct", "device": "cpu", "threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "torch": torch.__version__, "reps": args.reps, "results": results,
           "overlap_speedup": ratio, "same_greedy_outputs_every_rep": all(same), "provenance": finish(prov)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({"speedup (overlap / no overlap, >1 = overlap faster)": {k: round(v["median"], 3)
                                                                             for k, v in ratio.items()},
                      "same outputs": all(same)}, indent=1))


if __name__ == "__main__":
    main()
