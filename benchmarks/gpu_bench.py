"""lmc on one GPU against transformers and the physical floor, dummy-shaped llama-2-7b and llama-3-8b in bf16
(issue 13's table). Extends gpu_check.py, whose building blocks it runs (the model pair, logits check, decode and
few-shot timings), with:

- the ceilings of this card, measured in the same run: device-to-device copy bandwidth (bytes read + written) and
  an 8192^3 bf16 matrix product on random data; every floor below uses these;
- decode at batch 1, 8, 32, 64 and 256 for both shapes, against the floor (all weights but the embedding plus the
  KV read at the mean context, over the measured bandwidth) and the roofline floor (the linears at the longer of
  their weight read and their compute at the measured matrix rate, then the KV read);
- prefill of 32 prompts of 2,048 tokens (7B) and of 4 prompts of 8,192 tokens (8B, whose context allows it), as
  tok/s and the share of the measured matrix rate;
- the few-shot workload (128 programs, 1,200-token shared prefix) and a ShareGPT-like workload with no sharing
  (unrelated prompts and output lengths drawn from long-tailed distributions);
- logits against transformers in bf16 and fp32 (gpu_check.check_logits);
- the fused kernels' effect: a second lmc engine with them off (kernels/__init__.py's torch ops), decode timed
  alternately with the first, their logits compared, and a torch.profiler probe around Engine.generate for both.

Every speed figure is the median of --repeat runs (>= 3) with its spread, lmc then transformers within each
repetition. The JSON is rewritten after every case, so a run stopped early keeps what it measured.

    python benchmarks/gpu_bench.py --out results/gpu_bench.json           # on the H200 (writes gpu_bench.png too)
    python benchmarks/gpu_bench.py --smoke --out /tmp/b.json              # CPU, tiny shape: checks the script
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import contextmanager

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_check import build, check_logits, decode_speed, few_shot, lmc_logits, rel_err, sync, time_call  # noqa: E402
from record import finish, provenance, spread  # noqa: E402

import lmc.runtime.kernels as kernels  # noqa: E402
from lmc.runtime import Engine  # noqa: E402

TARGETS = {  # issue 13, H200 bf16: lmc / floor at most this
    ("llama-2-7b", 1): 1.25, ("llama-2-7b", 64): 1.35, ("llama-2-7b", 256): 1.5,
    ("llama-3-8b", 1): 1.3, ("llama-3-8b", 256): 1.6,
}
PREFILL_TARGET_SHARE = 0.65  # of the matrix rate, 2k-token prompts
FEW_SHOT_TARGET = 400.0  # programs/s


@torch.inference_mode()
def ceilings(dev, repeat) -> dict:
    """Copy bandwidth (4 GiB bf16, read + write counted) and bf16 matmul rate (8192^3, random data), each timed
    with CUDA events as the median of `repeat` batches of 10."""
    n = 1 << 31
    src, dst = torch.randn(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
    a, b = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))

    def timed(fn):
        fn()
        sync(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / 10

    bw = [2 * n * 2 / timed(lambda: dst.copy_(src)) for _ in range(repeat)]
    flops = [2 * 8192 ** 3 / timed(lambda: a @ b) for _ in range(repeat)]
    del src, dst, a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_s": spread(bw), "bf16_matmul_flop_s": spread(flops)}


def alternate(lmc, hf_run, repeat) -> tuple[list[float], list[float]]:
    """One warm-up of each, then `repeat` rounds of lmc then transformers: (lmc times, transformers times)."""
    lmc(), hf_run()
    lmc_t, hf_t = [], []
    for _ in range(repeat):
        lmc_t.append(lmc())
        hf_t.append(hf_run())
    return lmc_t, hf_t


def non_embedding_params(cfg) -> int:
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + cfg.num_attention_heads * hd * h
    return L * (attn + 3 * h * i + 2 * h) + h + h * cfg.vocab_size  # layers, final norm, lm_head


def prefill_flops(cfg, lens: list[int]) -> float:
    """Linear layers at every token (the lm-head at the last only) plus causal attention (QK^T and PV)."""
    lm_head = cfg.hidden_size * cfg.vocab_size
    linear = 2 * (non_embedding_params(cfg) - lm_head) * sum(lens) + 2 * lm_head * len(lens)
    attn = 4 * cfg.num_hidden_layers * cfg.hidden_size * sum(n * (n + 1) / 2 for n in lens)
    return linear + attn


@torch.inference_mode()
def prefill(hf, eng, cfg, dev, repeat, n_prompts, length, hf_chunk, matmul_rate) -> dict:
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(3, cfg.vocab_size, (n_prompts, length), generator=g)
    ids = prompts.tolist()
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}

    def lmc():
        eng.flush_cache()
        return time_call(lambda: eng.generate(input_ids=ids, sampling_params=params), dev)

    def hf_run():  # the base model over every token, the lm-head at the last one (what a prefill needs)
        def go():
            for i in range(0, n_prompts, hf_chunk):
                h = hf.model(prompts[i:i + hf_chunk].to(dev)).last_hidden_state[:, -1]
                hf.lm_head(h).argmax(-1)
        return time_call(go, dev)

    lmc_t, hf_t = alternate(lmc, hf_run, repeat)
    flops = prefill_flops(cfg, [length] * n_prompts)
    tokens = n_prompts * length
    return {"prompts": n_prompts, "prompt_tokens": length, "hf_batch": hf_chunk, "flops": flops,
            "lmc_tok_s": spread([tokens / t for t in lmc_t]), "hf_tok_s": spread([tokens / t for t in hf_t]),
            "lmc_tflop_s": spread([flops / t / 1e12 for t in lmc_t]),
            "lmc_share_of_matmul_rate": spread([flops / t / matmul_rate for t in lmc_t]),
            "lmc_vs_hf": spread([h / t for h, t in zip(hf_t, lmc_t)])}


def sharegpt_like(n, vocab, max_prompt, max_output, seed=5) -> tuple[list[list[int]], list[int]]:
    """ShareGPT's shape without its text: prompt and output lengths log-normal (medians ~180 and ~90 tokens, long
    tails), clipped to the limits; random token ids, so no two prompts share a prefix."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.exp(torch.randn(n, generator=g) * 0.9 + 5.2).clamp(16, max_prompt).long().tolist()
    o_len = torch.exp(torch.randn(n, generator=g) * 0.7 + 4.5).clamp(8, max_output).long().tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in p_len], o_len


@torch.inference_mode()
def no_sharing(hf, eng, cfg, dev, repeat, n, max_prompt, max_output, hf_chunk) -> dict:
    prompts, outs = sharegpt_like(n, cfg.vocab_size, max_prompt, max_output)
    params = [{"max_new_tokens": k, "temperature": 0, "ignore_eos": True} for k in outs]

    def lmc():
        eng.flush_cache()
        res = []
        t = time_call(lambda: res.extend(eng.generate(input_ids=prompts, sampling_params=params)), dev)
        assert [len(r["output_ids"]) for r in res] == outs
        return t

    def hf_run():  # arrival order, left-padded batches, each generating its longest output
        def go():
            for i in range(0, n, hf_chunk):
                chunk, k = prompts[i:i + hf_chunk], max(outs[i:i + hf_chunk])
                width = max(map(len, chunk))
                x = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=dev)
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=dev)
                hf.generate(x, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                            pad_token_id=0)
        return time_call(go, dev)

    lmc_t, hf_t = alternate(lmc, hf_run, repeat)
    out_tok = sum(outs)
    return {"requests": n, "prompt_tokens": sum(map(len, prompts)), "output_tokens": out_tok, "hf_batch": hf_chunk,
            "lmc_requests_s": spread([n / t for t in lmc_t]), "hf_requests_s": spread([n / t for t in hf_t]),
            "lmc_output_tok_s": spread([out_tok / t for t in lmc_t]), "hf_output_tok_s": spread([out_tok / t for t in hf_t]),
            "lmc_vs_hf": spread([h / t for h, t in zip(hf_t, lmc_t)])}


@contextmanager
def torch_ops_only():
    """The fused kernels off: kernels/__init__.py takes its torch reference for every tensor (the forward before
    the kernels existed). Graphs captured inside keep it."""
    saved = kernels._fused
    kernels._fused = lambda x: False
    try:
        yield
    finally:
        kernels._fused = saved


KERNEL_GROUPS = (  # first match wins; names as CUDA/Triton report them
    ("our fused kernels", ("_rms_norm_kernel", "_silu_mul_kernel", "_rope_qk_kernel")),
    ("attention", ("_decode_stage", "_extend_kernel", "flash", "attention")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("sampling and logits", ("argmax", "softmax", "exponential", "sort", "topk")),
)


@torch.inference_mode()
def probe(eng, cfg, dev, batch, prompt_len, steps) -> dict:
    """torch.profiler around Engine.generate (prefill of 1 token's worth excluded by difference): GPU kernel time
    per decode step, grouped, and the top kernels. The profiler inflates wall time; the GPU columns are the ones
    to read."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), generator=g).tolist()

    def run(n):
        eng.flush_cache()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
            sync(dev)
        per = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = e.cuda_time_total
            if t and str(e.device_type).endswith("CUDA"):  # kernels, not the host ops that launched them
                per[e.key] = (t, e.count)
        return per

    run(2)  # warm-up
    full, one = run(steps + 1), run(1)
    kernels_per_step = {}
    for k, (t, c) in full.items():
        t0, c0 = one.get(k, (0, 0))
        if t - t0 > 0:
            kernels_per_step[k] = ((t - t0) / steps / 1e3, (c - c0) / steps)  # ms, launches per step
    groups = {name: 0.0 for name, _ in KERNEL_GROUPS} | {"everything else": 0.0}
    for k, (ms, _) in kernels_per_step.items():
        name = next((n for n, keys in KERNEL_GROUPS if any(s.lower() in k.lower() for s in keys)), "everything else")
        groups[name] += ms
    top = sorted(kernels_per_step.items(), key=lambda kv: -kv[1][0])[:15]
    return {"batch": batch, "prompt_tokens": prompt_len, "steps": steps,
            "gpu_ms_per_step": sum(ms for ms, _ in kernels_per_step.values()),
            "launches_per_step": sum(c for _, c in kernels_per_step.values()), "groups_ms_per_step": groups,
            "top_kernels": [{"name": k[:120], "ms_per_step": ms, "launches_per_step": c} for k, (ms, c) in top]}


def kernel_ab(hf, eng, cfg, dev, repeat, batches, prompt_len, new, kv_tokens, probe_steps) -> dict:
    """A second engine with the fused kernels off: logits against the first, decode alternately, profiler probes."""
    dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[eng.runner.dtype]
    with torch_ops_only():  # outside inference mode: the engine's tables are written by its scheduler thread
        ref = Engine(eng.model_name, device=str(dev), dtype=dtype, weights=lambda: hf.state_dict().items(),
                     max_total_tokens=kv_tokens, cuda_graph_max_bs=max(batches))
    try:
        g = torch.Generator().manual_seed(7)
        lens = [int(x) for x in torch.randint(16, 96, (8,), generator=g)]
        seqs = [torch.randint(3, cfg.vocab_size, (k + 16,), generator=g).tolist() for k in lens]
        with torch_ops_only():
            want = lmc_logits(ref, seqs, lens, 16, dev)
        out = {"logits_fused_vs_torch_ops": rel_err(lmc_logits(eng, seqs, lens, 16, dev), want), "decode": []}
        for b in batches:
            ids = torch.randint(3, cfg.vocab_size, (b, prompt_len), generator=g).tolist()

            def step_ms(e, ids=ids):
                def gen(n):
                    e.flush_cache()
                    return time_call(lambda: e.generate(input_ids=ids, sampling_params={
                        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}), dev)
                return (gen(new + 1) - gen(1)) / new * 1e3

            def plain_ms():
                with torch_ops_only():
                    return step_ms(ref)

            fused, plain = alternate(lambda: step_ms(eng), plain_ms, repeat)
            out["decode"].append({"batch": b, "prompt_tokens": prompt_len, "generated": new,
                                  "fused_ms_per_step": spread(fused), "torch_ops_ms_per_step": spread(plain),
                                  "speedup": spread([p / f for p, f in zip(plain, fused)])})
        out["probe"] = {"fused": [probe(eng, cfg, dev, b, prompt_len, probe_steps) for b in batches]}
        with torch_ops_only():
            out["probe"]["torch_ops"] = [probe(ref, cfg, dev, b, prompt_len, probe_steps) for b in batches]
        return out
    finally:
        ref.shutdown()
        del ref


def run_shape(shape, cases, res, save, args, dev, dtype, ceil):
    bw, rate = ceil["copy_bytes_s"]["median"], ceil["bf16_matmul_flop_s"]["median"]
    t0 = time.perf_counter()
    cfg, hf, eng = build(shape, dev, dtype, args.kv_tokens, "auto", args.cuda_graph_max_bs)
    out = res["shapes"].setdefault(shape, {})
    out["build_s"], out["cuda_graphs"] = time.perf_counter() - t0, eng.runner.graphs is not None
    try:
        for name, fn in cases:
            if name not in args.cases:
                continue
            t = time.perf_counter()
            out[name] = fn(hf, eng, cfg, bw, rate)
            out.setdefault("case_seconds", {})[name] = time.perf_counter() - t
            print(shape, name, json.dumps(out[name])[:2000], flush=True)
            save()
    finally:
        eng.shutdown()
        del hf, eng
        gc.collect()
        torch.cuda.empty_cache() if dev.type == "cuda" else None


def plot(res: dict, path: str) -> None:
    """Decode ms/step per batch for each shape (lmc, transformers, floor; whiskers: min-max), and lmc / floor
    against the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s, r in res["shapes"].items() if r.get("decode")]
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes) + 1, figsize=(5 * (len(shapes) + 1), 4))
    for ax, shape in zip(axes, shapes):
        dec = res["shapes"][shape]["decode"]
        x = range(len(dec))
        for off, key, label, color in ((-0.2, "lmc_ms_per_step", "lmc", "#2a7ab9"),
                                       (0.2, "hf_ms_per_step", "transformers", "#b0b0b0")):
            med = [d[key]["median"] for d in dec]
            err = [[m - d[key]["min"] for m, d in zip(med, dec)], [d[key]["max"] - m for m, d in zip(med, dec)]]
            ax.bar([i + off for i in x], med, 0.4, yerr=err, label=label, color=color, capsize=3)
        ax.plot(list(x), [d["floor_ms_per_step"] for d in dec], "o-", color="#6bbf59", label="floor")
        ax.set_xticks(list(x), [str(d["batch"]) for d in dec])
        ax.set_yscale("log")
        ax.set(title=f"{shape} decode (ms/step)", xlabel="batch")
        ax.legend()
    ax = axes[-1]
    for shape in shapes:
        dec = res["shapes"][shape]["decode"]
        ax.plot([d["batch"] for d in dec], [d["lmc_over_floor"]["median"] for d in dec], "o-", label=f"{shape} lmc")
        tb = [(b, v) for (s, b), v in TARGETS.items() if s == shape]
        ax.plot([b for b, _ in tb], [v for _, v in tb], "x", markersize=9, label=f"{shape} target")
    ax.set_xscale("log", base=2)
    ax.set(title="lmc / floor (decode)", xlabel="batch")
    ax.axhline(1.0, color="#6bbf59", lw=1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from an existing --out JSON")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, small sizes: checks the script")
    ap.add_argument("--shapes", default="llama-2-7b,llama-3-8b")
    ap.add_argument("--cases", default="logits,decode,prefill,few_shot,no_sharing,kernels",
                    help="comma-separated subset of logits, decode, prefill, few_shot, no_sharing, kernels")
    ap.add_argument("--batches", default="1,8,32,64,256")
    # 256 prompts of 256 tokens and 97 generated fit 92,160 (the 7B's 48 GB): the decode case needs no retraction
    ap.add_argument("--kv-tokens", type=int, default=92160)
    ap.add_argument("--decode-steps", type=int, default=96,
                    help="decode ms/step = (t(1 + steps) - t(1)) / steps; at 32 steps one run's jitter at its two "
                         "ends moved a figure by up to 0.1 ms (H200, llama-2-7b batch 1: 3.90-4.07 ms)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256)
    ap.add_argument("--note", default="one lent GPU machine, nothing else running on the GPU")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.out) as f:
            return plot(json.load(f), os.path.splitext(args.out)[0] + ".png")
    if args.repeat < 3 and not args.smoke:
        ap.error("--repeat must be at least 3 (each figure is a median with its spread)")
    args.cases = set(args.cases.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    prov = provenance("benchmarks/gpu_bench.py", args.note)
    if args.smoke:
        dev, dtype, shapes = torch.device("cpu"), torch.float32, ["tiny"]
        batches, dec, pre, pre8k, fs, ns, ab = [1, 4], (16, 4), (2, 64, 2), None, (8, 100, 12, 4, 8), (6, 64, 8, 3), \
            dict(prompt_len=16, new=4, probe_steps=2)
    else:
        dev, dtype, shapes = torch.device("cuda"), torch.bfloat16, args.shapes.split(",")
        # 8,191: the 8B context is 8,192 and the prefill samples one token
        dec, pre, pre8k = (256, args.decode_steps), (32, 2048, 8), (4, 8191, 1)
        fs, ns = (128, 1200, 60, 8, 32), (64, 1024, 128, 16)
        ab = dict(prompt_len=256, new=32, probe_steps=32)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": str(dtype),
           "torch": torch.__version__, "transformers": transformers.__version__, "repeat": args.repeat,
           "targets": {"decode_over_floor": {f"{s} batch {b}": v for (s, b), v in TARGETS.items()},
                       "prefill_share_of_matmul_rate": PREFILL_TARGET_SHARE, "few_shot_programs_s": FEW_SHOT_TARGET},
           "shapes": {}}

    def save():
        res["provenance"] = finish(dict(prov))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)

    if dev.type == "cuda":
        res["ceilings"] = ceilings(dev, args.repeat)
    else:  # the smoke run has no meaningful ceilings: the H200's recorded ones keep its arithmetic going
        res["ceilings"] = {"copy_bytes_s": spread([4.21e12]), "bf16_matmul_flop_s": spread([797e12])}
    print("ceilings", json.dumps(res["ceilings"]), flush=True)
    save()
    for shape in shapes:
        long_prefill = pre8k if shape == "llama-3-8b" else None
        cases = [
            ("logits", lambda hf, eng, cfg, bw, rate: check_logits(hf, eng, cfg.vocab_size, dev)),
            ("decode", lambda hf, eng, cfg, bw, rate: [
                decode_speed(hf, eng, cfg, cfg.vocab_size, dev, args.repeat, b, dec[0], dec[1], bw, rate)
                for b in batches]),
            ("prefill", lambda hf, eng, cfg, bw, rate: [
                prefill(hf, eng, cfg, dev, args.repeat, *p, rate) for p in ([pre] if shape != "llama-3-8b" else [])
                + ([long_prefill] if long_prefill else [])]),
            ("few_shot", lambda hf, eng, cfg, bw, rate: few_shot(hf, eng, cfg.vocab_size, dev, args.repeat, *fs)),
            ("no_sharing", lambda hf, eng, cfg, bw, rate: no_sharing(hf, eng, cfg, dev, args.repeat, *ns)),
            ("kernels", lambda hf, eng, cfg, bw, rate: kernel_ab(
                hf, eng, cfg, dev, args.repeat, [batches[0], batches[-2] if len(batches) > 2 else batches[-1]],
                kv_tokens=24576 if dev.type == "cuda" else 4096, **ab)),
        ]
        if shape == "llama-3-8b":  # the 7B carries the workloads; the 8B its decode and the 8k prefill
            cases = [c for c in cases if c[0] in ("logits", "decode", "prefill")]
        run_shape(shape, cases, res, save, args, dev, dtype, res["ceilings"])
    save()
    plot(res, os.path.splitext(args.out)[0] + ".png")
    for shape, r in res["shapes"].items():
        for d in r.get("decode", []):
            print(f"{shape} decode batch {d['batch']}: lmc {d['lmc_ms_per_step']['median']:.2f} ms "
                  f"({d['lmc_ms_per_step']['min']:.2f}-{d['lmc_ms_per_step']['max']:.2f}), floor "
                  f"{d['floor_ms_per_step']:.2f}, lmc/floor {d['lmc_over_floor']['median']:.2f}x, "
                  f"hf {d['hf_ms_per_step']['median']:.2f} ms")
        for p in r.get("prefill", []):
            print(f"{shape} prefill {p['prompts']}x{p['prompt_tokens']}: lmc {p['lmc_tok_s']['median']:.0f} tok/s, "
                  f"{p['lmc_share_of_matmul_rate']['median']:.0%} of the matmul rate, hf {p['hf_tok_s']['median']:.0f}")
        if "few_shot" in r:
            print(f"{shape} few-shot: lmc {r['few_shot']['lmc_programs_s']['median']:.1f} programs/s, "
                  f"hf {r['few_shot']['hf_programs_s']['median']:.1f}")
        if "no_sharing" in r:
            print(f"{shape} no sharing: lmc {r['no_sharing']['lmc_output_tok_s']['median']:.0f} out tok/s, "
                  f"hf {r['no_sharing']['hf_output_tok_s']['median']:.0f}")
        for d in r.get("kernels", {}).get("decode", []):
            print(f"{shape} kernels batch {d['batch']}: fused {d['fused_ms_per_step']['median']:.2f} ms, torch ops "
                  f"{d['torch_ops_ms_per_step']['median']:.2f} ms")


if __name__ == "__main__":
    main()
