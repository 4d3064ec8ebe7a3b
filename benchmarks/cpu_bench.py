"""CPU benchmarks of the local engine on the embedded SmolLM2-135M-Instruct, each against transformers in the
same run (same weights, fp32, same thread count):

- few_shot:   64 programs sharing a ~600-token few-shot prefix, 40 unique tokens each, 4 generated;
              programs/s vs transformers' batched `generate`, and the share of prompt tokens served from cache.
- decode:     decode tok/s at batch 16 (64-token prompts, 64 generated, ignore_eos).
- no_sharing: unrelated prompts through a pool small enough to evict; time spent in radix-cache bookkeeping
              (match/insert/evict/lock) as a share of the engine's busy time.

    python benchmarks/cpu_bench.py [few_shot decode no_sharing] [--out benchmarks/results_cpu.json]
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


def few_shot(eng: Engine, hf) -> dict:
    tok = eng.tokenizer
    base = tok.encode(TEXT * 8)
    prefix, pool = base[:600], tok.encode(TEXT[::-1] * 12)  # unique parts: token runs from other text
    progs = [prefix + pool[7 * i:7 * i + 40] for i in range(64)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    eng.flush_cache()
    s0 = dict(eng.stats())
    t0 = time.perf_counter()
    out = eng.generate(input_ids=progs, sampling_params=params)
    t = time.perf_counter() - t0
    s1 = eng.stats()
    prompt = s1["prompt_tokens"] - s0["prompt_tokens"]
    cached = s1["cached_tokens"] - s0["cached_tokens"]
    hf_t = hf_generate(hf, progs, 4, 16)
    return {"programs": 64, "prefix_tokens": 600, "unique_tokens": 40, "generated": 4,
            "lmc_programs_s": 64 / t, "hf_programs_s": 64 / hf_t, "speedup": hf_t / t,
            "cached_share_after_first": cached / (prompt - len(progs[0])),
            "all_complete": all(len(r["output_ids"]) == 4 for r in out)}


def decode(eng: Engine, hf, batch=16, prompt_len=64, new=64) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, prompt_len), generator=g).tolist()

    def lmc(n):
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        return time.perf_counter() - t0

    # Per-step time = (time for new+1 tokens - time for 1 token) / new: prefill cancels out. Best of 2 each, since
    # a 2-core machine's timings move with whatever else runs.
    lmc(2)  # warm-up
    lmc_step = (min(lmc(new + 1) for _ in range(2)) - min(lmc(1) for _ in range(2))) / new
    hf_step = (min(hf_generate(hf, prompts, new + 1, batch) for _ in range(2))
               - min(hf_generate(hf, prompts, 1, batch) for _ in range(2))) / new
    return {"batch": batch, "prompt_tokens": prompt_len, "lmc_tok_s": batch / lmc_step, "hf_tok_s": batch / hf_step,
            "speedup": hf_step / lmc_step, "lmc_ms_per_step": lmc_step * 1e3, "hf_ms_per_step": hf_step * 1e3}


def no_sharing(_eng: Engine, _hf, n=96, prompt_len=200, new=16) -> dict:
    """A pool of 4,096 slots for 96 x 216 tokens: the cache fills and evicts throughout."""
    eng = Engine(MODEL, max_total_tokens=4096)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, 40000, (n, prompt_len), generator=g).tolist()
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True})
    wall = time.perf_counter() - t0
    s = eng.stats()
    eng.shutdown()
    return {"requests": n, "wall_s": wall, "cache_bookkeeping_s": s["cache_seconds"],
            "bookkeeping_share_of_wall": s["cache_seconds"] / wall, "cached_tokens": s["cached_tokens"]}


BENCHES = {"few_shot": few_shot, "decode": decode, "no_sharing": no_sharing}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("which", nargs="*", default=list(BENCHES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    eng, hf = Engine(MODEL), hf_model()
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    for name in tqdm(args.which, desc="benchmarks"):
        results[name] = BENCHES[name](eng, hf)
        tqdm.write(f"{name}: {json.dumps(results[name])}")
    results["env"] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    eng.shutdown()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\n{'benchmark':12s} {'lmc':>12s} {'transformers':>14s} {'ratio':>8s}")
    if "few_shot" in results:
        r = results["few_shot"]
        print(f"{'few-shot':12s} {r['lmc_programs_s']:9.2f} p/s {r['hf_programs_s']:11.2f} p/s {r['speedup']:7.2f}x"
              f"   cached share {r['cached_share_after_first']:.1%}")
    if "decode" in results:
        r = results["decode"]
        print(f"{'decode b16':12s} {r['lmc_tok_s']:9.1f} t/s {r['hf_tok_s']:11.1f} t/s {r['speedup']:7.2f}x")
    if "no_sharing" in results:
        r = results["no_sharing"]
        print(f"{'no sharing':12s} bookkeeping {r['bookkeeping_share_of_wall']:.2%} of wall ({r['wall_s']:.1f} s)")


if __name__ == "__main__":
    main()
