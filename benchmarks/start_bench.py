"""Start time of the embedded engine (SmolLM2-135M-Instruct, fp32, CPU) with the compiled forward, against eager.

Issue 13's target: the first start with the compiled forward under 60 s, the second under 15 s.

Every start is a fresh `python` process that times, from its own launch, until `Engine(...)` is ready to serve
(imports, weights, the C++ attention kernel already built, and for `compiled` the layer compiled or loaded and
the warm-up forwards); the process then, untimed, generates greedy tokens with logprobs for fixed prompts and
times decode steps, so the same run also answers "is the compiled forward right, and faster than eager?".
- first: `compiled` with an empty TORCHINDUCTOR_CACHE_DIR (no compiled layer, no inductor cache), --first-reps
  times, each with a fresh directory;
- second: `compiled` with the cache the first start filled, --reps times, alternated with `eager` starts.
Outputs: every compiled run's greedy tokens must equal the eager run's, logprobs within 1e-4 (max diff recorded).
Decode: the median runner step (forward + sampling) at batch 1 and 16 (cpu_speed.decode_step_s), per process.
JSON: benchmarks/results/start_cpu.json.

    python benchmarks/start_bench.py [--reps 3] [--first-reps 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from record import SHARED_MACHINE_NOTE, finish, provenance, spread  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODEL = "smollm2-135m-instruct"
OUT = os.path.join(os.path.dirname(__file__), "results", "start_cpu.json")
TARGETS_S = {"first": 60, "second": 15}
LOGPROB_TOL = 1e-4

# Run in a fresh interpreter: t0 is its first statement, so the interpreter's own start (~50 ms) is not counted;
# the parent's wall time around the process is recorded too (`process_s`).
_CHILD = """
import time
t0 = time.perf_counter()
import json, sys
sys.path.insert(0, {root!r})
from lmc.runtime import Engine
eng = Engine({model!r}, enable_torch_compile={compiled!r})
ready = time.perf_counter() - t0
failed = eng.runner.step_model.failed if {compiled!r} else None
sys.path.insert(0, {bench!r})
import torch
from cpu_speed import decode_step_s
prompts = torch.randint(100, 40000, (4, 24), generator=torch.Generator().manual_seed(7)).tolist()
out = eng.generate(input_ids=prompts, sampling_params={{"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}},
                   return_logprob=True)
decode = {{f"b{{b}}_ms": 1000 * decode_step_s(eng, b, 16, seed=b) for b in (1, 16)}}
eng.shutdown()
logprobs = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in out]
print("RESULT " + json.dumps({{"ready_s": ready, "failed": failed, "decode": decode,
                              "tokens": [r["output_ids"] for r in out], "logprobs": logprobs}}))
"""


def start(compiled: bool, env: dict) -> dict:
    code = _CHILD.format(root=ROOT, bench=os.path.dirname(os.path.abspath(__file__)), model=MODEL, compiled=compiled)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                       capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"start (compiled={compiled}) failed:\n{p.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_s"] = time.perf_counter() - t0
    return res


def compare(run: dict, eager: dict) -> dict:
    diff = max(abs(a - b) for ra, rb in zip(run["logprobs"], eager["logprobs"]) for a, b in zip(ra, rb))
    return {"tokens_equal": run["tokens"] == eager["tokens"], "max_logprob_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3, help="second starts (and eager starts), alternated")
    ap.add_argument("--first-reps", type=int, default=1, help="first starts, each with an empty cache")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    prov = provenance("benchmarks/start_bench.py", SHARED_MACHINE_NOTE)
    runs: dict = {"first": [], "second": [], "eager": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.first_reps):
            env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, f"inductor{i}")}
            runs["first"].append(start(True, env))
            print(f"first start: {runs['first'][-1]['ready_s']:.1f} s", flush=True)
        for rep in range(args.reps):  # the last first start's cache serves the second starts
            for name in ("second", "eager") if rep % 2 == 0 else ("eager", "second"):
                runs[name].append(start(name == "second", env))
                print(f"{name} start: {runs[name][-1]['ready_s']:.1f} s", flush=True)
    eager = runs["eager"][0]
    checks = [compare(r, eager) for name in ("first", "second", "eager") for r in runs[name]]
    out = {
        "model": MODEL, "dtype": "float32", "cpus": os.cpu_count(),
        "targets_s": TARGETS_S,
        "start_s": {name: spread([r["ready_s"] for r in rs]) for name, rs in runs.items()},
        "process_s": {name: spread([r["process_s"] for r in rs]) for name, rs in runs.items()},
        "compile_failed": [r["failed"] for r in runs["first"] + runs["second"] if r["failed"]],
        "decode_step_ms": {name: {k: spread([r["decode"][k] for r in rs]) for k in rs[0]["decode"]}
                           for name, rs in runs.items()},
        "outputs": {"tokens_equal": all(c["tokens_equal"] for c in checks),
                    "max_logprob_diff": max(c["max_logprob_diff"] for c in checks), "tolerance": LOGPROB_TOL,
                    "against": "the first eager run: 4 prompts of 24 random tokens, 16 greedy tokens each"},
        "note": ("start_s: seconds from the child interpreter's first statement to Engine ready; process_s: the "
                 "parent's wall time around the whole child (start, the checks and decode timing, exit)"),
        "provenance": finish(prov),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: out[k] for k in ("start_s", "decode_step_ms", "outputs", "compile_failed")}, indent=1))
    if not out["outputs"]["tokens_equal"] or out["outputs"]["max_logprob_diff"] > LOGPROB_TOL:
        sys.exit("compiled outputs differ from eager")


if __name__ == "__main__":
    main()
