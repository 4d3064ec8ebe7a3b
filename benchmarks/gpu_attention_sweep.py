"""Decode attention (attention/triton_kernels.decode_attention) over a grid of stage-1 configurations, at the
decode shapes of gpu_bench.py: llama-2-7b (32 q / 32 kv heads) and llama-3-8b (32 / 8), head_dim 128, bf16,
batches 1-256 at 272 tokens of context. Each figure is the per-layer time of 32 layers (their own KV buffers, as a
step reads them: far past the L2) in one replayed CUDA graph, launched as the decode graphs launch it
(max_seq_len = the context length), against the KV-read floor at the copy bandwidth measured here.

    python benchmarks/gpu_attention_sweep.py --out attention_sweep.json    # on the GPU
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_gemm_sweep import copy_bandwidth  # noqa: E402

from lmc.runtime.attention.triton_kernels import _decode_config, decode_attention  # noqa: E402

CONFIGS = [(bn, w, s) for bn, (w, s) in itertools.product((16, 32, 64, 128), ((4, 2), (4, 3), (8, 2), (2, 2)))]


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=272)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "copy_bytes_s": bw, "cases": []}
    ctx_len, max_ctx, d = args.context, 4096, 128
    for (name, hq, hkv), b in itertools.product((("llama-2-7b", 32, 32), ("llama-3-8b", 32, 8)),
                                                [int(x) for x in args.batches.split(",")]):
        slots = b * ctx_len + 1
        ks = [torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        vs = [torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        table = torch.zeros(b + 1, max_ctx, dtype=torch.int32, device="cuda")
        table[1:, :ctx_len] = (1 + torch.arange(b * ctx_len, device="cuda", dtype=torch.int32)).view(b, ctx_len)
        rows = torch.arange(1, b + 1, device="cuda")
        seq = torch.full((b,), ctx_len, device="cuda", dtype=torch.int32)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        floor = b * ctx_len * hkv * d * 2 * 2 / bw * 1e6
        ref = decode_attention(q, ks[0], vs[0], table, rows, seq, d ** -0.5, max_seq_len=max_ctx).float()
        row = {"shape": name, "batch": b, "context": ctx_len, "floor_us_per_layer": floor,
               "default": _decode_config(b * hkv, d * 2), "configs": []}
        for cfg in CONFIGS:
            try:
                out = decode_attention(q, ks[0], vs[0], table, rows, seq, d ** -0.5, max_seq_len=max_ctx,
                                       config=cfg).float()
                err = ((out - ref).norm() / ref.norm()).item()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for k, v in zip(ks, vs):
                        decode_attention(q, k, v, table, rows, seq, d ** -0.5, max_seq_len=max_ctx, config=cfg)
                g.replay()
                ts = []
                for _ in range(5):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    g.replay()
                    e.record()
                    e.synchronize()
                    ts.append(s.elapsed_time(e) * 1e3 / args.layers)
                row["configs"].append({"config": cfg, "us_per_layer": sorted(ts)[2], "rel_err": err})
                del g
            except Exception as ex:  # noqa: BLE001 -- a config over the shared-memory limit
                row["configs"].append({"config": cfg, "error": str(ex)[:80]})
        ok = [c for c in row["configs"] if "us_per_layer" in c]
        best = min(ok, key=lambda c: c["us_per_layer"])
        dflt = next(c for c in ok if tuple(c["config"]) == tuple(row["default"]))
        row["best"] = best
        res["cases"].append(row)
        print(f"{name} b={b:3d} floor {floor:7.1f} us/layer  default {row['default']} {dflt['us_per_layer']:7.1f} "
              f"({floor / dflt['us_per_layer']:.0%})  best {best['config']} {best['us_per_layer']:7.1f} "
              f"({floor / best['us_per_layer']:.0%}) err {best['rel_err']:.1e}", flush=True)
        del ks, vs
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
