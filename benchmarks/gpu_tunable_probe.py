"""Whether PyTorch's TunableOp finds faster cuBLAS solutions than the default heuristics for the decode GEMMs that
stay on cuBLAS (batch 64 and 256, llama-2-7b and llama-3-8b shapes, bf16): each shape timed with the default, then
with TunableOp tuning on (its picks written next to the output as tunableop_results.csv). A probe on the GPU machine:

    python benchmarks/gpu_tunable_probe.py --ms 64,256 --out $OUT/tunable_probe.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

# name -> (N, K) of the weight
SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
          "8b_lm_head": (128256, 4096), "7b_qkv": (12288, 4096), "7b_gate_up": (22016, 4096),
          "7b_down": (4096, 11008)}


def us_per_call(fn, n: int = 50) -> float:
    """Microseconds per call of fn(i); the caller rotates over copies of the weight so that L2 does not hold it."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(n):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,256", help="the GEMMs' row counts (decode batch sizes)")
    ap.add_argument("--out", default="/tmp/tunable_probe.json")
    a = ap.parse_args()
    dev, out = torch.device("cuda"), {}
    copies = {name: 4 if n * k < 2e8 else 2 for name, (n, k) in SHAPES.items()}
    weights = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies[name])]
               for name, (n, k) in SHAPES.items()}
    for phase in ("default", "tunable"):
        if phase == "tunable":
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            torch.cuda.tunable.set_max_tuning_duration(200)
            torch.cuda.tunable.set_filename(os.path.join(os.path.dirname(a.out), "tunableop_results.csv"))
        for name, (n, k) in SHAPES.items():
            w = weights[name]
            for m in (int(v) for v in a.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t = us_per_call(lambda i: F.linear(x, w[i % len(w)]))
                row = out.setdefault(f"{name}@{m}", {})
                row[phase], row["tflops_" + phase] = round(t, 2), round(2 * m * n * k / t / 1e6, 1)
                print(phase, name, m, row[phase], "us", row["tflops_" + phase], "TFLOP/s", flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
