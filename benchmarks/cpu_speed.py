"""CPU runtime speed of the embedded SmolLM2-135M-Instruct (fp32), before against after the CPU-path work of issue 13,
and with its linears in bf16.

Configurations (all in one process, alternated within every repetition):
- before:   eager forward, the gather + SDPA attention (`attention_backend="torch"`): the attention as it was (the
            linears, elementwise ops and argmax are the C++ CPU kernels in every configuration).
- kernel:   eager forward, the paged C++ attention kernel (`attention_backend="cpu"`, the CPU default).
- compiled: the kernel plus the torch.compile'd forward (`enable_torch_compile=True`).
- bf16:     the kernel with `dtype="bfloat16"`: the linears in bf16 on oneDNN (AMX or AVX-512 BF16), the rest fp32
            (model/linear.py); its outputs may differ from fp32's.
- blocks:   the kernel with the linears on the GGUF's Q4_1 / Q8_0 blocks (model/gguf_blocks.py; the engine's default
            since): the same outputs as `kernel`, bit for bit, from ~96 MB of weights a step instead of 540.
The first four run the linears on fp32 panels (`gguf_blocks=False`).
The batched sampler serves all three (it replaced the per-request loops; greedy decoding is an argmax either way).

Measures:
- decode tok/s at batch 1 and 16 (64-token random prompts, ignore_eos): batch / the median decode step
  (runner time: forward + sampling) of a run;
- no_sharing: 48 unrelated 200-token prompts, 16 generated each, wall time and tok/s of output;
- start: seconds from a fresh `python` process to an Engine ready to serve, per configuration (see measure_starts).
Each figure is the median of --reps repetitions with min and max (record.spread). JSON:
benchmarks/results/cpu_speed.json, with the command and load of the run in `provenance` (record.provenance) and,
for the start times (which an --only-start run may measure separately), in `start_provenance`.

`--gemm` (alone; into the same JSON, key `gemm`): the linears' GEMM at the model's shapes, one step's worth of
distinct weights (30 layers x qkv, o, gate_up, down: 425 MB, more than the caches hold, as in the engine; the
lm-head on its own), per row count of x: the engine's Linear (the panel GEMM, or MKL from linear.LARGE_ROWS rows),
the panel GEMM alone, MKL's `F.linear` on the dense weight, oneDNN's packed `_linear_pointwise` and, where the CPU
runs bf16 natively, the engine's Linear packed in bf16 (`bf16`: x rounded to bf16, y back in fp32; panels below
linear.BF16_LARGE_ROWS rows, oneDNN from there) and its two parts alone (`bf16_panels`: the panel GEMM on bf16
panels; `bf16_onednn`: oneDNN's bf16 GEMM, AMX where the CPU has it), alternated within every repetition;
milliseconds per step of linears.

    python benchmarks/cpu_speed.py [--reps 3] [--configs before kernel compiled] [--skip-start | --only-start]
    python benchmarks/cpu_speed.py --gemm [--reps 5] [--gemm-rows 1 8 16 64 256 1024 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from lmc.runtime import Engine  # noqa: E402
from record import SHARED_MACHINE_NOTE, finish, provenance, spread  # noqa: E402

MODEL = "smollm2-135m-instruct"
CONFIGS = {
    "before": {"attention_backend": "torch", "gguf_blocks": False},
    "kernel": {"attention_backend": "cpu", "gguf_blocks": False},
    "compiled": {"attention_backend": "cpu", "enable_torch_compile": True, "gguf_blocks": False},
    "bf16": {"attention_backend": "cpu", "dtype": "bfloat16"},
    "blocks": {"attention_backend": "cpu"},
}
OUT = os.path.join(os.path.dirname(__file__), "results", "cpu_speed.json")


def decode_step_s(eng: Engine, batch: int, new: int, seed: int) -> float:
    """Median over the decode steps of one generate call of the runner's time per step (forward + sampling;
    the scheduler's bookkeeping around it is not counted). A median of steps, not a difference of two wall
    times, because other processes on this machine stall single steps for seconds."""
    prompts = torch.randint(100, 40000, (batch, 64), generator=torch.Generator().manual_seed(seed)).tolist()
    runner, steps = eng.runner, []

    def timed_launch(sb):
        t0 = time.perf_counter()
        h = launch(sb)
        h.started = t0
        return h

    def timed_collect(h):
        out = collect(h)
        if h.sb.is_decode:
            steps.append(time.perf_counter() - h.started)
        return out

    launch, collect = runner.launch, runner.collect
    # The scheduler calls runner.launch and runner.collect: instance attributes wrap them for this call only.
    runner.launch, runner.collect = timed_launch, timed_collect
    try:
        eng.flush_cache()
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new + 1, "temperature": 0,
                                                         "ignore_eos": True})
    finally:
        del runner.launch, runner.collect
    return statistics.median(steps)


def no_sharing_s(eng: Engine, seed: int, n: int = 48, prompt_len: int = 200, new: int = 16) -> float:
    prompts = torch.randint(100, 40000, (n, prompt_len), generator=torch.Generator().manual_seed(seed)).tolist()
    eng.flush_cache()
    t0 = time.perf_counter()
    out = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0,
                                                           "ignore_eos": True})
    assert all(len(r["output_ids"]) == new for r in out)
    return time.perf_counter() - t0


_START = """
import sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
from lmc.runtime import Engine
eng = Engine({model!r}, **{kwargs!r})
print("READY", time.perf_counter() - t0, flush=True)
eng.shutdown()
"""


def start_s(kwargs: dict, env: dict) -> float:
    """Wall seconds from launching a fresh interpreter to the engine being ready (imports, weights, builds)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    code = _START.format(root=root, model=MODEL, kwargs=kwargs)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    assert "READY" in out.stdout, out.stderr[-2000:]
    return time.perf_counter() - t0


def measure_starts(configs: list[str], reps: int) -> dict:
    """Per configuration: `warm` (caches filled, `reps` runs, alternated across configurations) and, where the
    configuration builds something, `first` once (each takes minutes on this machine): `kernel` with an empty
    kernel-build dir (the C++ attention build), `compiled` with an empty inductor cache but the kernel built
    (the torch.compile cost alone)."""
    res: dict = {name: {} for name in configs}
    with tempfile.TemporaryDirectory() as ext, tempfile.TemporaryDirectory() as ind:
        env = {"TORCH_EXTENSIONS_DIR": ext, "TORCHINDUCTOR_CACHE_DIR": ind}
        for name in ("kernel", "compiled"):
            if name in configs:
                res[name]["first"] = start_s(CONFIGS[name], env)
                print(f"first start {name}: {res[name]['first']:.1f} s", flush=True)
        warm: dict = {name: [] for name in configs}
        for rep in range(reps):
            for name in configs if rep % 2 == 0 else list(reversed(configs)):
                warm[name].append(start_s(CONFIGS[name], env))
                print(f"warm start {name}: {warm[name][-1]:.1f} s", flush=True)
    for name in configs:
        res[name]["warm"] = spread(warm[name])
    return res


GEMM_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
               "lm_head": (576, 49152)}  # (in K, out N) of SmolLM2-135M's linears


def gemm_ms(rows: list[int], reps: int) -> dict:
    """{"layers" | "lm_head": {backend: {rows: spread of ms}}} (see the module docstring)."""
    import torch.nn.functional as F

    from lmc.runtime.attention.cpu_kernel import panels
    from lmc.runtime.model.linear import Linear, bf16_supported

    ops = panels()
    if ops is None:
        raise SystemExit("--gemm: no panel GEMM on this machine (neither AVX-512 nor AVX2, or no C++ toolchain)")
    g = torch.Generator().manual_seed(0)
    groups = {"layers": [GEMM_SHAPES[n] for n in ("qkv", "o", "gate_up", "down")] * 30,
              "lm_head": [GEMM_SHAPES["lm_head"]]}
    out: dict = {}
    for group, dims in groups.items():
        lins = []
        for k, n in dims:
            lin = Linear(k, n)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n, k, generator=g))
            lin.prepack()
            lins.append(lin)
        onednn = [torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 16) for lin in lins]
        bf16 = []
        for lin in lins if bf16_supported() else ():
            b = Linear(lin.in_features, lin.out_features)
            b.weight = lin.weight  # shared: prepack in bf16 drops its own reference only
            b.prepack(torch.bfloat16)
            bf16.append(b)
        backends = {
            "engine": lambda x, i: lins[i](x),
            "panels": lambda x, i: ops.panel_linear(x, lins[i].packed, lins[i].out_features, None),
            "mkl": lambda x, i: F.linear(x, lins[i].weight),
            "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        }
        if bf16:
            backends["bf16"] = lambda x, i: bf16[i](x)
            backends["bf16_panels"] = lambda x, i: ops.panel_linear(x, bf16[i].packed, bf16[i].out_features, None)
            backends["bf16_onednn"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
                x.bfloat16(), bf16[i].large, None, "none", [], "")
        res: dict = {name: {} for name in backends}
        for m in rows:
            xs = [torch.randn(m, k, generator=g) for k, _ in dims]
            times: dict = {name: [] for name in backends}
            for rep in range(reps + 1):  # the first repetition warms up, unmeasured
                for name in backends if rep % 2 == 0 else list(reversed(backends)):
                    fn = backends[name]
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        for i, x in enumerate(xs):
                            fn(x, i)
                        dt = time.perf_counter() - t0
                    if rep:
                        times[name].append(dt * 1e3)
            for name in backends:
                res[name][str(m)] = spread(times[name])
            print(f"gemm {group} M={m}: " + ", ".join(f"{name} {res[name][str(m)]['median']:.1f} ms"
                                                       for name in backends), flush=True)
        out[group] = res
        del lins, onednn, bf16
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--decode-new", type=int, default=32)
    ap.add_argument("--no-sharing-reps", type=int, default=None, help="default: --reps")
    ap.add_argument("--no-sharing-configs", nargs="*", default=None, help="default: --configs")
    ap.add_argument("--skip-start", action="store_true")
    ap.add_argument("--only-start", action="store_true", help="measure start times into an existing JSON")
    ap.add_argument("--start-reps", type=int, default=None, help="default: --reps")
    ap.add_argument("--gemm", action="store_true", help="measure the linears' GEMM into an existing JSON")
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[1, 8, 16, 64, 256, 1024, 4096])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    prov = provenance("benchmarks/cpu_speed.py", SHARED_MACHINE_NOTE)
    if args.gemm:
        out = json.load(open(args.out)) if os.path.exists(args.out) else {}
        load = os.getloadavg()
        out["gemm"] = {"ms_per_step": gemm_ms(args.gemm_rows, args.reps), "shapes_k_n": GEMM_SHAPES,
                       "threads": torch.get_num_threads(), "load_average_before_after": [load, os.getloadavg()],
                       "provenance": finish(prov)}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        return
    if args.only_start:
        out = json.load(open(args.out)) if os.path.exists(args.out) else {}
        load = os.getloadavg()
        out["start_s"] = measure_starts(args.configs, args.start_reps or args.reps)
        out["start_load_average_before_after"] = [load, os.getloadavg()]
        out["start_provenance"] = finish(prov)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps(out["start_s"], indent=1))
        return
    load_before = os.getloadavg()
    engines = {name: Engine(MODEL, **CONFIGS[name]) for name in args.configs}
    for eng in engines.values():  # warm-up: first-touch of KV pages, allocator, compiled shapes
        decode_step_s(eng, 16, 2, seed=99)
    runs: dict = {name: {"decode_b1_tok_s": [], "decode_b16_tok_s": [], "no_sharing_s": []} for name in engines}
    for rep in range(args.reps):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))  # alternate who goes first
        for name in order:
            eng, r = engines[name], runs[name]
            r["decode_b1_tok_s"].append(1 / decode_step_s(eng, 1, args.decode_new, seed=rep))
            r["decode_b16_tok_s"].append(16 / decode_step_s(eng, 16, args.decode_new, seed=rep))
            if rep < (args.no_sharing_reps if args.no_sharing_reps is not None else args.reps) and \
                    name in (args.no_sharing_configs if args.no_sharing_configs is not None else engines):
                r["no_sharing_s"].append(no_sharing_s(eng, seed=rep))
            print(f"rep {rep} {name}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in r.items() if v), flush=True)
    for eng in engines.values():
        eng.shutdown()
    results = {name: {k: spread(v) for k, v in r.items() if v} for name, r in runs.items()}
    for r in results.values():
        if "no_sharing_s" in r:
            r["no_sharing_out_tok_s"] = spread([48 * 16 / s for s in r["no_sharing_s"]["runs"]])
    out = {
        "model": MODEL, "dtype": "float32" + ("; bf16: the linears in bfloat16" if "bf16" in args.configs else ""), "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "reps": args.reps, "configs": {k: CONFIGS[k] for k in args.configs},
        "results": results,
        "note": ("Shared machine: 2 cores used concurrently by other engineers' tests and benchmarks; the load "
                 "average is recorded before and after. Configurations alternate within each repetition, so load "
                 "changes hit all of them; absolute numbers are slower than on an idle machine."),
        "load_average_before_after": [load_before],
        "provenance": prov,
    }
    if os.path.exists(args.out):  # start times and the GEMM sweep of earlier --only-start / --gemm runs are kept
        prev = json.load(open(args.out))
        out.update({k: prev[k] for k in ("start_s", "start_load_average_before_after", "start_provenance", "gemm")
                    if k in prev})
    if not args.skip_start:
        out["start_s"] = measure_starts(args.configs, args.start_reps or args.reps)
        out["start_provenance"] = prov
    out["load_average_before_after"].append(os.getloadavg())
    finish(prov)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\n{'config':10s} {'b1 tok/s':>16s} {'b16 tok/s':>18s} {'no-sharing s':>18s}")
    for name, r in results.items():
        cells = [r[k] for k in ("decode_b1_tok_s", "decode_b16_tok_s", "no_sharing_s") if k in r]
        print(f"{name:10s} " + " ".join(f"{c['median']:7.1f} ({c['min']:.1f}-{c['max']:.1f})" for c in cells))


if __name__ == "__main__":
    main()
