"""A/B of decode-step variants on the GPU, in one engine per shape (dummy weights, bf16): programmatic dependent
launch of the Triton kernels (kernels/launch.py) on, off and in CUDA graphs only, decode stage 1's key tile when few programs run
(attention/triton_kernels._decode_block_n: 128 keys for bf16 D=128, against 64), and the MLP's SiLU-mul in the
gate_up GEMM's epilogue against its own kernel (kernels.FUSE_SILU_MUL), and RoPE with the KV write in the QKV GEMM's
epilogue against its own kernel (kernels.FUSE_ROPE).

Each variant gets its own CUDA graphs (captured with its switches set); the variants then alternate, `--rounds`
times: the decode graph of each bucket replayed alone (ms, CUDA events), wall ms per decode step as gpu_bench
measures it ((t(1 + steps) - t(1)) / steps through Engine.generate), and, for llama-2-7b, gpu_bench's few-shot
workload in programs/s. Greedy tokens of every variant are compared with the first's.

    python benchmarks/gpu_step_ab.py --out ab.json                  # on the H200
    python benchmarks/gpu_step_ab.py --smoke --out /tmp/ab.json     # CPU, tiny shape: checks the script
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_check import time_call  # noqa: E402
from gpu_profile import graph_replay_ms  # noqa: E402
from record import finish, provenance, spread  # noqa: E402

from lmc.runtime import Engine, kernels  # noqa: E402
from lmc.runtime.attention import triton_kernels  # noqa: E402
from lmc.runtime.kernels import launch  # noqa: E402

_BLOCK_N = triton_kernels._decode_block_n
# name -> (launch.MODE, stage 1's key tile for few programs: None = _decode_block_n's, kernels.FUSE_SILU_MUL,
# kernels.FUSE_ROPE)
VARIANTS = {"base": ("off", None, True, True), "pdl": ("on", None, True, True),
            "pdl_graphs": ("graphs", None, True, True), "pdl_bn64": ("on", 64, True, True),
            "pdl_silu_apart": ("on", None, False, True), "pdl_rope_apart": ("on", None, True, False)}


def set_variant(name: str) -> None:
    launch.MODE, block_n, kernels.FUSE_SILU_MUL, kernels.FUSE_ROPE = VARIANTS[name]
    triton_kernels._decode_block_n = _BLOCK_N if block_n is None else (lambda row_bytes, n=block_n: n)


def gen(eng, ids, n):
    return eng.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})


def step_ms(eng, ids, steps, dev) -> float:
    eng.flush_cache()
    t_full = time_call(lambda: gen(eng, ids, steps + 1), dev)
    eng.flush_cache()
    t_one = time_call(lambda: gen(eng, ids, 1), dev)
    return (t_full - t_one) / steps * 1e3


def run_shape(shape, args, dev, dtype, res, save):
    from lmc.runtime.cuda_graph import DecodeGraphs

    eng = Engine(f"dummy:{shape}", device=str(dev), dtype=dtype, max_total_tokens=args.kv_tokens,
                 cuda_graph_max_bs=args.max_bs)
    out = res["shapes"][shape] = {"variants": {}}
    g = torch.Generator().manual_seed(6)
    vocab = eng.runner.cfg.vocab_size
    batches = [b for b in args.batches if b <= args.max_bs]
    prompts = {b: torch.randint(3, vocab, (b, args.prompt_len), generator=g).tolist() for b in batches}
    if args.long_prompt:  # batch 1 at a long context: the split decode's other regime
        prompts["1@long"] = torch.randint(3, vocab, (1, args.long_prompt), generator=g).tolist()
        batches.append("1@long")
    few = None
    if args.few_shot and shape == "llama-2-7b":
        prefix = torch.randint(3, vocab, (1200,), generator=g).tolist()
        few = [prefix + torch.randint(3, vocab, (60,), generator=g).tolist() for _ in range(128)]
    graphs = {}
    try:
        for name in args.variants:  # graphs per variant, captured with its switches; first run compiles
            set_variant(name)
            eng.runner.graphs = None
            gc.collect()
            graphs[name] = eng.runner.graphs = DecodeGraphs(eng.runner, args.max_bs) if dev.type == "cuda" else None
            v = out["variants"][name] = {"replay_ms": {b: [] for b in batches}, "step_ms": {b: [] for b in batches},
                                         "few_shot_programs_s": []}
            v["tokens"] = [r["output_ids"] for r in gen(eng, prompts[max(b for b in batches if isinstance(b, int))][:8],
                                                        24)]
            for b in batches:
                gen(eng, prompts[b], 3)
            if few:
                gen(eng, few, 8)  # the cascade graph of bucket 128, captured on first use
        base = out["variants"][args.variants[0]]["tokens"]
        for name in args.variants:
            out["variants"][name]["greedy_tokens_equal_first"] = out["variants"][name].pop("tokens") == base
        for _ in range(args.rounds):
            for name in args.variants:
                set_variant(name)
                eng.runner.graphs = graphs[name]
                v = out["variants"][name]
                for b in batches:
                    gen(eng, prompts[b], 2)  # the bucket's static buffers hold a real step of this batch
                    bucket = len(prompts[b])
                    v["replay_ms"][b].append(graph_replay_ms(eng, bucket, dev))
                    v["step_ms"][b].append(step_ms(eng, prompts[b], args.steps, dev))
                for _ in range(2 if few else 0):
                    eng.flush_cache()
                    v["few_shot_programs_s"].append(len(few) / time_call(lambda: gen(eng, few, 8), dev))
            save()
        for name, v in out["variants"].items():
            for key in ("replay_ms", "step_ms"):
                v[key] = {b: spread(x) if None not in x else None for b, x in v[key].items()}
            v["few_shot_programs_s"] = spread(v["few_shot_programs_s"]) if v["few_shot_programs_s"] else None
        save()
    finally:
        eng.runner.graphs = None
        graphs.clear()
        eng.shutdown()
        del eng
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="llama-2-7b,llama-3-8b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--long-prompt", type=int, default=3000, help="also batch 1 at this prompt length (0: not)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--kv-tokens", type=int, default=81920)
    ap.add_argument("--max-bs", type=int, default=256)
    ap.add_argument("--no-few-shot", dest="few_shot", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape: checks the script")
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        dev, dtype, shapes = torch.device("cpu"), "float32", ["tiny"]
        args.batches, args.steps, args.prompt_len, args.kv_tokens, args.rounds = [1, 4], 3, 16, 4096, 2
        args.long_prompt = 100
    else:
        dev, dtype, shapes = torch.device("cuda"), "bfloat16", args.shapes.split(",")
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "variants": {k: dict(zip(("pdl_mode", "stage1_block_n_few_programs", "fuse_silu_mul", "fuse_rope"), v))
                        for k, v in VARIANTS.items()},
           "shapes": {}}
    prov = provenance("benchmarks/gpu_step_ab.py", "probe: the decode step's launch variants, alternating")

    def save():
        res["provenance"] = finish(dict(prov))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for shape in shapes:
        run_shape(shape, args, dev, dtype, res, save)
    save()
    for shape, r in res["shapes"].items():
        for name, v in r["variants"].items():
            rp = {b: round(x["median"], 3) for b, x in v["replay_ms"].items() if x}
            st = {b: round(x["median"], 3) for b, x in v["step_ms"].items()}
            fs = v["few_shot_programs_s"]
            print(f"{shape} {name:18s} replay {rp} step {st} few-shot {fs and round(fs['median'], 1)} "
                  f"same tokens {v['greedy_tokens_equal_first']}")


if __name__ == "__main__":
    main()
