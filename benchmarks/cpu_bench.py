"""CPU benchmarks of the local engine on the embedded SmolLM2-135M-Instruct, each against transformers in the
same run (same weights, fp32, same thread count):

- few_shot:   64 programs sharing a ~600-token few-shot prefix, 40 unique tokens each, 4 generated;
              programs/s vs transformers' batched `generate`, and the share of prompt tokens served from cache.
- decode:     decode tok/s at batch 16 (64-token prompts, 64 generated, ignore_eos).
- no_sharing: unrelated prompts through a pool small enough to evict; time spent in radix-cache bookkeeping
              (match/insert/evict/lock) as a share of the engine's busy time.

    python benchmarks/cpu_bench.py [few_shot decode no_sharing] [--repeat 3] [--out benchmarks/results/cpu.json]

Each benchmark runs --repeat times, lmc then transformers within each repetition; every figure is stored with
its spread (record.spread: median, min, max, runs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from lmc.runtime import Engine  # noqa: E402
from lmc.runtime.model.loader import resolve  # noqa: E402

from record import SHARED_MACHINE_NOTE, finish, provenance, spread  # noqa: E402

MODEL = "smollm2-135m-instruct"
TEXT = ("Q: What is the capital of Japan?\nA: Tokyo\nQ: Which planet is known as the red planet?\nA: Mars\n"
        "Q: Who wrote Romeo and Juliet?\nA: William Shakespeare\nQ: What is the boiling point of water?\nA: 100 "
        "degrees Celsius\nQ: How many legs does a spider have?\nA: Eight\nQ: What gas do plants absorb?\nA: Carbon "
        "dioxide\nQ: What is the largest ocean?\nA: The Pacific Ocean\nQ: Which metal is liquid at room "
        "temperature?\nA: Mercury\n")


def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve(MODEL).tokenizer_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], new: int, batch: int) -> float:
    """Batched greedy generate of equal-length prompts (no padding needed); returns seconds."""
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        x = torch.tensor(prompts[i:i + batch])
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=2)
    return time.perf_counter() - t0


def few_shot(eng: Engine, hf, repeat: int) -> dict:
    tok = eng.tokenizer
    base = tok.encode(TEXT * 8)
    prefix, pool = base[:600], tok.encode(TEXT[::-1] * 12)  # unique parts: token runs from other text
    progs = [prefix + pool[7 * i:7 * i + 40] for i in range(64)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    lmc_s, hf_s, cached_share, complete = [], [], [], True
    for _ in range(repeat):
        eng.flush_cache()
        s0 = dict(eng.stats())
        t0 = time.perf_counter()
        out = eng.generate(input_ids=progs, sampling_params=params)
        lmc_s.append(time.perf_counter() - t0)
        s1 = eng.stats()
        prompt = s1["prompt_tokens"] - s0["prompt_tokens"]
        cached = s1["cached_tokens"] - s0["cached_tokens"]
        cached_share.append(cached / (prompt - len(progs[0])))
        complete &= all(len(r["output_ids"]) == 4 for r in out)
        hf_s.append(hf_generate(hf, progs, 4, 16))
    return {"programs": 64, "prefix_tokens": 600, "unique_tokens": 40, "generated": 4, "hf_batch": 16,
            "lmc_programs_s": spread([64 / t for t in lmc_s]), "hf_programs_s": spread([64 / t for t in hf_s]),
            "speedup": spread([h / t for h, t in zip(hf_s, lmc_s)]),
            "cached_share_after_first": spread(cached_share), "all_complete": complete}


def decode(eng: Engine, hf, repeat: int, batch=16, prompt_len=64, new=64) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, prompt_len), generator=g).tolist()

    def lmc(n):
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        return time.perf_counter() - t0

    # Per-step time = (time for new+1 tokens - time for 1 token) / new: prefill cancels out.
    lmc(2)  # warm-up
    lmc_step, hf_step = [], []
    for _ in range(repeat):
        lmc_step.append((lmc(new + 1) - lmc(1)) / new)
        hf_step.append((hf_generate(hf, prompts, new + 1, batch) - hf_generate(hf, prompts, 1, batch)) / new)
    return {"batch": batch, "prompt_tokens": prompt_len, "generated": new,
            "lmc_tok_s": spread([batch / t for t in lmc_step]), "hf_tok_s": spread([batch / t for t in hf_step]),
            "speedup": spread([h / t for h, t in zip(hf_step, lmc_step)]),
            "lmc_ms_per_step": spread([t * 1e3 for t in lmc_step]),
            "hf_ms_per_step": spread([t * 1e3 for t in hf_step])}


def no_sharing(_eng: Engine, _hf, repeat: int, n=96, prompt_len=200, new=16) -> dict:
    """A pool of 4,096 slots for 96 x 216 tokens: the cache fills and evicts throughout."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, 40000, (n, prompt_len), generator=g).tolist()
    walls, books, cached = [], [], []
    for _ in range(repeat):
        eng = Engine(MODEL, max_total_tokens=4096)
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True})
        walls.append(time.perf_counter() - t0)
        s = eng.stats()
        eng.shutdown()
        books.append(s["cache_seconds"])
        cached.append(s["cached_tokens"])
    return {"requests": n, "prompt_tokens": prompt_len, "generated": new, "pool_tokens": 4096,
            "wall_s": spread(walls), "cache_bookkeeping_s": spread(books),
            "bookkeeping_share_of_wall": spread([b / w for b, w in zip(books, walls)]), "cached_tokens": max(cached)}


BENCHES = {"few_shot": few_shot, "decode": decode, "no_sharing": no_sharing}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=list(BENCHES), help=f"benchmarks to run (default: all of {list(BENCHES)})")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each benchmark (default 3)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu.json"))
    args = ap.parse_args()
    unknown = set(args.which) - set(BENCHES)
    if unknown or args.repeat < 1:
        ap.error(f"unknown benchmark(s) {sorted(unknown)}" if unknown else "--repeat must be at least 1")
    torch.set_num_threads(os.cpu_count() or 1)
    prov = provenance("benchmarks/cpu_bench.py", SHARED_MACHINE_NOTE)
    eng, hf = Engine(MODEL), hf_model()
    # A partial run (some benchmarks named) replaces only those; each section keeps the provenance of its run.
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    for name in tqdm(args.which, desc="benchmarks"):
        results[name] = BENCHES[name](eng, hf, args.repeat)
        results[name]["provenance"] = prov
        tqdm.write(f"{name}: {json.dumps(results[name])}")
    finish(prov)
    results["env"] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    eng.shutdown()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    med = {k: {f: (v["median"] if isinstance(v, dict) and "median" in v else v) for f, v in r.items()}
           for k, r in results.items() if k in BENCHES}
    print(f"\nmedians of {args.repeat} run(s)\n{'benchmark':12s} {'lmc':>12s} {'transformers':>14s} {'ratio':>8s}")
    if "few_shot" in med:
        r = med["few_shot"]
        print(f"{'few-shot':12s} {r['lmc_programs_s']:9.2f} p/s {r['hf_programs_s']:11.2f} p/s {r['speedup']:7.2f}x"
              f"   cached share {r['cached_share_after_first']:.1%}")
    if "decode" in med:
        r = med["decode"]
        print(f"{'decode b16':12s} {r['lmc_tok_s']:9.1f} t/s {r['hf_tok_s']:11.1f} t/s {r['speedup']:7.2f}x")
    if "no_sharing" in med:
        r = med["no_sharing"]
        print(f"{'no sharing':12s} bookkeeping {r['bookkeeping_share_of_wall']:.2%} of wall ({r['wall_s']:.1f} s)")


if __name__ == "__main__":
    main()
