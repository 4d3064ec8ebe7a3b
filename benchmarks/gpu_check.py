"""lmc vs transformers on one GPU with a dummy-shaped model (default llama-2-7b, bf16), in one run:

1. correctness: transformers' own seeded initialisation, the same weights loaded into lmc; logits of a prefill
   and of 16 teacher-forced decode steps for 8 prompts, as relative error ||lmc - hf|| / ||hf||;
2. decode tok/s at batch 1 and 32 against transformers and the weight-read floor;
3. the few-shot workload: 128 programs, a 1,200-token shared prefix, 60 unique tokens, 8 generated.

    python benchmarks/gpu_check.py --repeat 5 --out results.json      # on the H200
    python benchmarks/gpu_check.py --smoke                            # CPU, tiny shape: checks the script

With --repeat N every speed figure is measured N times, lmc then transformers within each repetition, and stored
as record.spread (median, min, max, runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lmc.runtime import Engine, SamplingParams  # noqa: E402
from lmc.runtime.core import Req  # noqa: E402
from lmc.runtime.model.loader import resolve  # noqa: E402
from lmc.runtime.runner import BatchBuilder, decode_batch  # noqa: E402

from record import finish, provenance, spread  # noqa: E402

COPY_BW = 4.21e12  # bytes/s, device-to-device copy measured on the H200 (DESIGN 8)
BASELINE_RUNS = 3  # t(1) runs whose median decode_speed subtracts


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def transformers_model(cfg, dev: torch.device, dtype: torch.dtype, seed: int = 0):
    """transformers' LlamaForCausalLM with its own seeded initialisation, built in `dtype` the way from_pretrained
    builds it: weights in `dtype`, the RoPE inverse frequencies (a non-persistent buffer) in fp32. Not
    `LlamaForCausalLM(cfg).to(dtype)`: `.to` rounds that buffer to bf16 too (0.8660 -> 0.8672), which moves every
    rotary angle by up to 2^-9 of itself, and `copy.deepcopy(model).float()`, the fp32 reference, keeps the rounded
    frequencies. lmc's RoPE (exact fp32 frequencies, as from_pretrained's) then looked twice as far from "fp32"
    as transformers' bf16 on the H200 (0.158 against 0.076), the whole gap being the two models' rotary angles."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if model.model.rotary_emb.inv_freq.dtype != torch.float32:  # another transformers version may build it otherwise
        raise RuntimeError(f"transformers built its RoPE frequencies in {model.model.rotary_emb.inv_freq.dtype}, "
                           "not float32: the fp32 reference would not be one")
    return model


def build(shape: str, dev: torch.device, dtype: torch.dtype, kv_tokens: int, attention: str, graph_bs: int):
    cfg = resolve(f"dummy:{shape}").hf_config
    hf = transformers_model(cfg, dev, dtype)
    eng = Engine(f"dummy:{shape}", device=str(dev), dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
                 weights=lambda: hf.state_dict().items(), max_total_tokens=kv_tokens, attention_backend=attention,
                 cuda_graph_max_bs=graph_bs)
    return cfg, hf, eng


@torch.inference_mode()
def hf_logits(model, seqs, lens, steps, dev):
    """transformers' logits for the same teacher-forced positions as lmc_logits: one forward per whole sequence."""
    per_prompt = [model(torch.tensor([s[:k + steps - 1]], device=dev)).logits[0, k - 1:].float()
                  for s, k in zip(seqs, lens)]
    return [torch.stack([p[t] for p in per_prompt]) for t in range(steps)]


@torch.inference_mode()
def lmc_logits(eng, seqs, lens, steps, dev):
    """Drive the runner directly (the engine is idle): one extend batch, then `steps - 1` decode batches whose
    input tokens are forced, so both models see the same sequence whatever they would have sampled.
    Returns [steps][n_prompts, vocab]."""
    runner, n, alloc = eng.runner, len(seqs), eng.scheduler.allocator
    reqs = [Req(s, SamplingParams(max_new_tokens=1)) for s in seqs]
    for i, r in enumerate(reqs):
        r.row = 1 + i  # rows 1..n of the idle engine (row 0 is the dummy row)
    b = BatchBuilder()
    for r, k in zip(reqs, lens):
        b.add(r, 0, k, alloc.alloc(k), True)
    out = [runner.launch(b.build([])).forward.result()[0].clone()]
    kv = list(lens)
    rows = torch.tensor([r.row for r in reqs], device=dev)
    for _ in range(steps - 1):  # a decode step reads its input ids from the token buffer: force them there
        runner.token_buf[rows] = torch.tensor([s[k] for s, k in zip(seqs, kv)], device=dev)
        # .clone(): a replay's logits are the CUDA graph's buffer, which the next replay overwrites
        out.append(runner.launch(decode_batch(reqs, kv, alloc.alloc(n), [])).forward.result()[0].clone())
        kv = [k + 1 for k in kv]
    with torch.inference_mode(False):  # the rebuilt host tables are written later by the scheduler thread, which
        eng.scheduler.reset()  # runs outside inference mode: inference tensors there would fail its first step
    return out


def rel_err(a_steps, b_steps):
    """a, b: [steps][n_prompts, vocab] -> max/mean of ||a - b|| / ||b|| for the prefill step and decode steps."""
    errs = {"prefill": [], "decode": []}
    for t, (a, b) in enumerate(zip(a_steps, b_steps)):
        e = ((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).tolist()
        errs["prefill" if t == 0 else "decode"].extend(e)
    return {k: {"max": max(v), "mean": sum(v) / len(v)} for k, v in errs.items()}


@torch.inference_mode()
def check_logits(hf, eng, vocab, dev, n_prompts=8, steps=16):
    """lmc (Triton and torch attention) against transformers in the same dtype, and both against transformers in
    fp32 on the same weights: the last line is the dtype's own noise floor."""
    import copy

    from lmc.runtime.attention import make_backend

    g = torch.Generator().manual_seed(1)
    lens = [int(x) for x in torch.randint(16, 96, (n_prompts,), generator=g)]
    seqs = [torch.randint(3, vocab, (k + steps,), generator=g).tolist() for k in lens]

    ref = hf_logits(hf, seqs, lens, steps, dev)
    res = {"lmc_vs_hf": rel_err(lmc_logits(eng, seqs, lens, steps, dev), ref)}
    if dev.type == "cuda":
        own, graphs = eng.runner.attn, eng.runner.graphs
        eng.runner.graphs = None
        res["lmc_no_cuda_graph_vs_hf"] = rel_err(lmc_logits(eng, seqs, lens, steps, dev), ref)
        eng.runner.attn = make_backend("torch", dev)
        res["lmc_torch_attention_vs_hf"] = rel_err(lmc_logits(eng, seqs, lens, steps, dev), ref)
        eng.runner.attn, eng.runner.graphs = own, graphs
        hf32 = copy.deepcopy(hf).float()
        ref32 = hf_logits(hf32, seqs, lens, steps, dev)
        del hf32
        res["lmc_vs_hf_fp32"] = rel_err(lmc_logits(eng, seqs, lens, steps, dev), ref32)
        res["hf_vs_hf_fp32"] = rel_err(ref, ref32)
    return res


def time_call(fn, dev):
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


@torch.inference_mode()
def decode_speed(hf, eng, cfg, vocab, dev, repeat, batch, prompt_len, new, bandwidth=COPY_BW, matmul_rate=None):
    """`bandwidth`: bytes/s the floor assumes (gpu_bench.py passes the copy bandwidth measured in its run).

    With `matmul_rate` (FLOP/s) the result also holds the roofline floor: the linears take the longer of reading
    their weights and computing at that rate, then the KV is read. At large batches the linears are compute-bound,
    and the KV read cannot overlap them (attention needs the QKV product and feeds the next one), so this is the
    floor a step can reach there; the plain floor assumes every byte streams at full bandwidth."""
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g)
    ids = prompts.tolist()

    def lmc(n):
        eng.flush_cache()
        return time_call(lambda: eng.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                                              "ignore_eos": True}), dev)

    def hf_gen(n):
        x = prompts.to(dev)
        return time_call(lambda: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                             min_new_tokens=n, do_sample=False, pad_token_id=0), dev)

    # Warm-up at the timed length: a 2-token warm-up left transformers' first timed run 2-3x slower than the rest
    # (H200, 2026-12-01), which a single run then quoted as its speed.
    lmc(new + 1)
    hf_gen(new + 1)

    def per_step(gen):
        # (time for new+1 tokens - time for 1) / new: the prefill cancels out. The baseline is the median of three
        # runs: one slow t(1) moved a single difference by its whole error (H200, 2026-12-02: llama-2-7b batch 1
        # runs 4.06, 3.90 and 3.56 ms, the last below the decode graph's replay alone).
        base = statistics.median(gen(1) for _ in range(BASELINE_RUNS))
        return (gen(new + 1) - base) / new

    lmc_step, hf_step = [], []
    for _ in range(repeat):
        lmc_step.append(per_step(lmc))
        hf_step.append(per_step(hf_gen))
    p = sum(x.numel() for x in hf.parameters()) - cfg.vocab_size * cfg.hidden_size  # all but the embedding
    kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    kv_read = batch * (prompt_len + new // 2) * kv_tok / bandwidth
    floor = p * 2 / bandwidth + kv_read
    roofline = {} if matmul_rate is None else {
        "roofline_ms_per_step": (max(p * 2 / bandwidth, 2 * p * batch / matmul_rate) + kv_read) * 1e3}
    if roofline:
        roofline["lmc_over_roofline"] = spread([t * 1e3 / roofline["roofline_ms_per_step"] for t in lmc_step])
    return roofline | {"batch": batch, "prompt_tokens": prompt_len, "generated": new,
            "lmc_ms_per_step": spread([t * 1e3 for t in lmc_step]), "hf_ms_per_step": spread([t * 1e3 for t in hf_step]),
            "floor_ms_per_step": floor * 1e3, "lmc_tok_s": spread([batch / t for t in lmc_step]),
            "hf_tok_s": spread([batch / t for t in hf_step]),
            "lmc_vs_hf": spread([h / t for h, t in zip(hf_step, lmc_step)]),
            "lmc_over_floor": spread([t / floor for t in lmc_step])}


@torch.inference_mode()
def few_shot(hf, eng, vocab, dev, repeat, programs, prefix_len, unique, new, hf_chunk):
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, vocab, (prefix_len,), generator=g).tolist()
    progs = [prefix + torch.randint(3, vocab, (unique,), generator=g).tolist() for _ in range(programs)]
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    # Warm-up over the whole workload: its batch-128 decode takes the cascade CUDA graph, captured on first use,
    # which a 4-program warm-up never reaches (the first timed run then paid the capture: 256 and 60 programs/s
    # against ~370 in the H200 runs at ae4e8eb and 378c4fa).
    eng.generate(input_ids=progs, sampling_params=params)

    def hf_chunk_gen(i):
        x = torch.tensor(progs[i:i + hf_chunk], device=dev)
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=0)

    def hf_all():
        for i in range(0, programs, hf_chunk):
            hf_chunk_gen(i)

    hf_chunk_gen(0)  # warm-up
    lmc_t, hf_t, cached_ratio, prefill_forwards, complete = [], [], [], [], True
    for _ in range(repeat):
        eng.flush_cache()
        before = dict(eng.stats())
        out = []
        lmc_t.append(time_call(lambda: out.extend(eng.generate(input_ids=progs, sampling_params=params)), dev))
        after = eng.stats()
        prompt = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cached_tokens"] - before["cached_tokens"]
        cached_ratio.append(cached / max(1, prompt - len(progs[0])))
        prefill_forwards.append(after["prefill_forwards"] - before["prefill_forwards"])
        complete &= all(len(r["output_ids"]) == new for r in out)
        hf_t.append(time_call(hf_all, dev))
    return {"programs": programs, "prefix_tokens": prefix_len, "unique_tokens": unique, "generated": new,
            "hf_batch": hf_chunk, "lmc_programs_s": spread([programs / t for t in lmc_t]),
            "hf_programs_s": spread([programs / t for t in hf_t]),
            "lmc_vs_hf": spread([h / t for h, t in zip(hf_t, lmc_t)]), "cached_ratio_after_first": spread(cached_ratio),
            "prefill_forwards": max(prefill_forwards), "all_complete": complete}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, small sizes")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only-logits", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256, help="0: no CUDA graphs")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every speed figure (default 3)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    prov = provenance("benchmarks/gpu_check.py",
                      "one lent GPU machine, nothing else running on the GPU; host load recorded as load_avg_1m_*")
    if args.smoke:
        dev, dtype, shape = torch.device("cpu"), torch.float32, "tiny"
        sizes = dict(decode=[(1, 16, 4), (4, 16, 4)], fs=(16, 120, 12, 4, 8), kv=8192)
    else:
        dev, dtype, shape = torch.device("cuda"), getattr(torch, args.dtype), args.shape
        sizes = dict(decode=[(1, 512, 64), (32, 512, 64)], fs=(128, 1200, 60, 8, 32), kv=args.kv_tokens)
    t0 = time.perf_counter()
    cfg, hf, eng = build(shape, dev, dtype, sizes["kv"], args.attention, args.cuda_graph_max_bs)
    res = {"shape": shape, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "dtype": str(dtype), "torch": torch.__version__, "transformers": transformers.__version__, "build_s": time.perf_counter() - t0,
           "cuda_graphs": eng.runner.graphs is not None, "repeat": args.repeat}
    res["logits_rel_err"] = check_logits(hf, eng, cfg.vocab_size, dev)
    print("logits", json.dumps(res["logits_rel_err"]), flush=True)
    if args.only_logits:
        sizes["decode"], sizes["fs"] = [], None
    res["decode"] = [decode_speed(hf, eng, cfg, cfg.vocab_size, dev, args.repeat, *d) for d in sizes["decode"]]
    for d in res["decode"]:
        print("decode", json.dumps(d), flush=True)
    if sizes["fs"]:
        res["few_shot"] = few_shot(hf, eng, cfg.vocab_size, dev, args.repeat, *sizes["fs"])
        print("few_shot", json.dumps(res["few_shot"]), flush=True)
    eng.shutdown()
    res["provenance"] = finish(prov)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    for d in res["decode"]:
        print(f"decode batch {d['batch']}: lmc {d['lmc_ms_per_step']['median']:.2f} ms/step "
              f"(min {d['lmc_ms_per_step']['min']:.2f}, max {d['lmc_ms_per_step']['max']:.2f}), transformers "
              f"{d['hf_ms_per_step']['median']:.2f}, lmc/hf {d['lmc_vs_hf']['median']:.2f}x, floor "
              f"{d['floor_ms_per_step']:.2f} ms")
    if "few_shot" in res:
        f = res["few_shot"]
        print(f"few-shot: lmc {f['lmc_programs_s']['median']:.1f} programs/s (min {f['lmc_programs_s']['min']:.1f}, "
              f"max {f['lmc_programs_s']['max']:.1f}), transformers {f['hf_programs_s']['median']:.1f}")


if __name__ == "__main__":
    main()
