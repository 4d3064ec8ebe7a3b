"""What fusing the small kernels away could gain at decode batch 1 and 8: the decode graph replayed with the
RMSNorms (and their residual adds) and the SiLU-mul skipped, left as views of their inputs (the wrong numbers at
the right shapes: a bound, not a model), alternating with the real graph, 4 rounds. A probe for issue 13's batch-1
target: the skinny GEMMs' fixed cost per launch (~4 us over their weight floor each, h200_probe/gemm_sweep*.json)
against the elementwise kernels between them.

    python benchmarks/gpu_fusion_bound.py llama-2-7b out.json      # on the GPU machine
    python benchmarks/gpu_fusion_bound.py smollm2-135m out.json 1,4  # the batches (default 1,8)

no_rope also skips RoPE with the KV write (q is the QKV output's first heads; the cache keeps stale rows) and
no_small every elementwise kernel: what a decoder layer of GEMMs and attention alone would take.
"""
import gc
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_profile import graph_replay_ms  # noqa: E402

from lmc.runtime import Engine, kernels  # noqa: E402
from lmc.runtime.cuda_graph import DecodeGraphs  # noqa: E402

VARIANTS = ("base", "no_norm", "no_silu", "no_both", "no_rope", "no_small")
_REAL = {n: getattr(kernels, n) for n in ("add_rms_norm", "silu_mul", "rms_norm", "rope_q_write_kv")}


def patch(variant: str) -> None:
    """The kernels module as `variant` has it (kernels are looked up there at each call, so capture sees it)."""
    for n, f in _REAL.items():
        setattr(kernels, n, f)
    if variant in ("no_norm", "no_both", "no_small"):
        kernels.add_rms_norm = lambda residual, x, w, eps: (residual, x)
        kernels.rms_norm = lambda x, w, eps: x
    if variant in ("no_silu", "no_both", "no_small"):
        kernels.silu_mul = lambda gate_up: gate_up[:, :gate_up.shape[1] // 2]
    if variant in ("no_rope", "no_small"):
        kernels.rope_q_write_kv = lambda qkv, cos, sin, hq, hkv, hd, *_: qkv[:, :hq * hd].reshape(-1, hq, hd)


def main() -> None:
    shape, out = sys.argv[1], sys.argv[2]
    batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,8").split(",")]
    dev = torch.device("cuda")
    eng = Engine(f"dummy:{shape}", device="cuda", dtype="bfloat16", max_total_tokens=16384,
                 cuda_graph_max_bs=max(batches))
    g = torch.Generator().manual_seed(6)
    prompts = {b: torch.randint(3, eng.runner.cfg.vocab_size, (b, 256), generator=g).tolist() for b in batches}

    def gen(ids, n):
        return eng.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                             "ignore_eos": True})

    graphs = {}
    for v in VARIANTS:  # each variant's graphs, captured with its kernels
        patch(v)
        eng.runner.graphs = None
        gc.collect()
        graphs[v] = eng.runner.graphs = DecodeGraphs(eng.runner, max(batches))
        for ids in prompts.values():
            gen(ids, 3)
    runs = {v: {b: [] for b in prompts} for v in VARIANTS}
    for _ in range(4):
        for v in VARIANTS:
            patch(v)
            eng.runner.graphs = graphs[v]
            for b, ids in prompts.items():
                gen(ids, 2)  # the bucket's static buffers hold a real step of this batch
                runs[v][b].append(graph_replay_ms(eng, b, dev, n=100))
    median = {v: {b: statistics.median(x) for b, x in r.items()} for v, r in runs.items()}
    print(torch.cuda.get_device_name(), shape, json.dumps(median, indent=1))
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "shape": shape, "replay_ms_runs": runs,
                   "replay_ms_median": median}, f, indent=1)
    patch("base")
    eng.runner.graphs = None
    graphs.clear()
    eng.shutdown()


if __name__ == "__main__":
    main()
