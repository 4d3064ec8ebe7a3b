"""Decode-sized linears on the GPU: cuBLAS (F.linear) against the Triton skinny GEMM (kernels/skinny_gemm.py) over
a grid of tile configurations, for every linear of llama-2-7b and llama-3-8b at decode batch sizes. Each figure is
the per-call time inside a replayed CUDA graph (as a decode step runs them) over enough weight copies that they
do not fit in L2, against the byte floor (weight + activations over the copy bandwidth measured here).

    python benchmarks/gpu_gemm_sweep.py --out gemm_sweep.json    # on the GPU; prints the best config per shape

--gated: the gate_up shapes with the SiLU-mul in the skinny GEMM's epilogue (skinny_gemm(..., gated=True), tiles
of at least 32 rows) against the product and kernels.silu_mul as two launches (the table's tile, or cuBLAS where the
table has none), both timed the same way: skinny_gemm.GATED_CONFIGS.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lmc.runtime import kernels  # noqa: E402
from lmc.runtime.kernels.skinny_gemm import CONFIGS as TABLE, _block_m, _skinny_gemm_kernel, skinny_gemm  # noqa: E402

SHAPES = {  # name: (N, K)
    "llama-2-7b qkv": (12288, 4096), "llama-2-7b o": (4096, 4096), "llama-2-7b gate_up": (22016, 4096),
    "llama-2-7b down": (4096, 11008), "llama-2-7b lm_head": (32000, 4096),
    "llama-3-8b qkv": (6144, 4096), "llama-3-8b o": (4096, 4096), "llama-3-8b gate_up": (28672, 4096),
    "llama-3-8b down": (4096, 14336), "llama-3-8b lm_head": (128256, 4096),
    "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
}
CONFIGS = [(bn, bk, w, s) for bn, bk, (w, s) in itertools.product((16, 32, 64), (128, 256, 512),
                                                                    ((4, 3), (4, 5), (8, 4)))]
# --split: split-K tiles (BLOCK_N, BLOCK_K, warps, stages, SPLIT_K), for the shapes with few output tiles.
# --large: tiles for M > skinny_gemm.MAX_M (a batch-256 decode's GEMMs, near compute-bound), with BLOCK_M:
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K), against cuBLAS.
LARGE_CONFIGS = [(bm, bn, bk, w, st, 1) for (bm, bn, w), (bk, st) in itertools.product(
    ((64, 64, 4), (64, 128, 4), (64, 256, 8), (128, 64, 4), (128, 128, 4), (128, 128, 8), (128, 256, 8),
     (256, 128, 8)), ((64, 3), (64, 4), (128, 3)))] + [
    (bm, bn, 64, w, 4, sk) for (bm, bn, w), sk in itertools.product(((64, 128, 4), (128, 128, 8)), (2, 4))]
SPLIT_CONFIGS = [(bn, bk, 4, st, sk) for bn, (bk, st), sk in itertools.product((32, 64, 128), ((128, 4), (256, 3)),
                                                                               (1, 2, 4, 8))]


def tiled_gemm(x, w, cfg):
    """skinny_gemm's kernel with an explicit BLOCK_M (the --large probe): cfg = (BM, BN, BK, warps, stages, split)."""
    bm, bn, bk, warps, stages, split = cfg
    m, k = x.shape
    n = w.shape[0]
    k_split = -(-(-(-k // split)) // bk) * bk
    split = -(-k // k_split)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (-(-n // bn), -(-m // bm), split)
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    counters = _COUNTERS if split > 1 else y
    _skinny_gemm_kernel[grid](x, w, y, parts, counters, m, n, k, k_split, x.stride(0), w.stride(0), y.stride(0),
                              y, y, 0, y, y, y, 0, 0,  # COS .. HKV: no RoPE, so unused
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, IEEE=False, SPLIT_K=split,
                              PDL=False, num_warps=warps, num_stages=stages)
    return y


_COUNTERS = None


def copy_bandwidth() -> float:
    n = 1 << 30
    a, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    return 2 * n * 2 * 10 / (s.elapsed_time(e) / 1e3)


def per_call_us(fn, xs, ws, replays=10) -> float:
    """fn(x, w) over every weight copy in one CUDA graph, replayed; median replay / copies."""
    fn(xs[0], ws[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x, w in zip(xs, ws):
            fn(x, w)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(ws))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--split", action="store_true", help="sweep the split-K tiles (SPLIT_CONFIGS) instead")
    ap.add_argument("--large", action="store_true", help="tiles with BLOCK_M for M > MAX_M (LARGE_CONFIGS)")
    ap.add_argument("--gated", action="store_true", help="gate_up with the SiLU-mul epilogue (module docstring)")
    args = ap.parse_args()
    if args.gated:
        args.shapes = ",".join(name for name in args.shapes.split(",") if name.endswith("gate_up"))
        configs = [c for c in CONFIGS if c[0] >= 32]
        gemm = lambda x, w, cfg: skinny_gemm(x, w, cfg, gated=True)  # noqa: E731
    else:
        configs = LARGE_CONFIGS if args.large else SPLIT_CONFIGS if args.split else CONFIGS
        gemm = tiled_gemm if args.large else skinny_gemm
    global _COUNTERS
    _COUNTERS = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "copy_bytes_s": bw, "shapes": []}
    for (name, (n, k)), m in itertools.product(shapes.items(), [int(x) for x in args.ms.split(",")]):
        copies = max(4, -(-(512 << 20) // (n * k * 2)))  # >= 512 MiB of weights: far past the 60 MB L2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor = (n * k + m * (n + k)) * 2 / bw * 1e6
        compute_us = 2 * m * n * k / 783e12 * 1e6  # at gpu_bench's measured bf16 matmul rate
        row = {"shape": name, "N": n, "K": k, "M": m, "floor_us": floor, "compute_us": compute_us,
               "cublas_us": per_call_us(lambda x, w: F.linear(x, w), xs, ws), "triton": []}
        ref = F.linear(xs[0], ws[0]).float()
        current = None if args.large else TABLE.get((_block_m(m), n, k))  # the table's tile too, so a sweep's best never loses to it
        if args.gated:  # the baseline: the product as kernels.linear runs it, then silu_mul
            row["apart_us"] = per_call_us(lambda x, w: kernels.silu_mul(kernels.linear(x, w)), xs, ws)
            gu = ref.double()
            ref = (F.silu(gu[:, :n // 2]) * gu[:, n // 2:]).float()
        for cfg in configs + ([current] if current is not None and current not in configs else []):
            try:
                err = ((gemm(xs[0], ws[0], cfg).float() - ref).norm() / ref.norm()).item()
                t = per_call_us(lambda x, w, cfg=cfg: gemm(x, w, cfg), xs, ws)
            except Exception as e:  # noqa: BLE001 -- a config over the shared-memory limit
                row["triton"].append({"config": cfg, "error": str(e)[:80]})
                continue
            row["triton"].append({"config": cfg, "us": t, "rel_err": err})
        ok = [t for t in row["triton"] if "us" in t]
        best = min(ok, key=lambda t: t["us"])
        row["top3"] = sorted(ok, key=lambda t: t["us"])[:3]
        row["best"] = best
        res["shapes"].append(row)
        apart = f"apart {row['apart_us']:7.1f} " if args.gated else ""
        print(f"{name:20s} M={m:3d} floor {floor:7.1f} us compute {compute_us:7.1f}  cublas {row['cublas_us']:7.1f} "
              f"({floor / row['cublas_us']:.0%})  {apart}triton {best['us']:7.1f} ({floor / best['us']:.0%}) "
              f"{best['config']} err {best['rel_err']:.1e} top3 {[(t['config'], round(t['us'], 1)) for t in row['top3']]}", flush=True)
        del ws, xs
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
