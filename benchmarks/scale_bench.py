"""Scale-out on CPU: a shared-prefix workload on lmc replicas behind SGLang's gateway (sglang-router).

Workload (in the style of SGLang's `generated-shared-prefix`): G groups of P requests; the requests of a group share
a long system prompt and differ in a short question; they arrive interleaved (shuffled, fixed seed), C at a time.
Each replica is pinned to one core with one torch thread, and its KV pool holds about half of the groups'
prefixes, so a replica that sees every group keeps evicting.

Systems, alternated within each run (the replicas' caches are flushed before each system):
- one:         one replica (core 0) behind the gateway;
- round_robin: two replicas (cores 0 and 1), the gateway's round_robin policy;
- cache_aware: the same two replicas, the gateway's cache_aware policy (approximate radix tree per worker).
The three gateways run side by side in front of the same replica processes (one load of the model each).

Reported per system: throughput (requests/s, output tokens/s), the share of prompt tokens served from a replica's
prefix cache, median latency, and each replica's share of the requests; median of the runs with min-max
(record.spread); the command and the machine's load in `provenance` (record.provenance).

    python benchmarks/scale_bench.py [--runs 3] [--out benchmarks/results/scale.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import httpx
except ImportError:  # installs that ship httpx under the name httpx2
    import httpx2 as httpx

from lmc.server.replicas import (Child, ReplicaSet, gateway_command, gateway_env, free_port,  # noqa: E402
                                 plan_replicas)
from record import finish, provenance, spread  # noqa: E402

MODEL = "smollm2-135m-instruct"
WORDS = ("river stone lantern orchard copper meadow harbor signal velvet canyon ember willow glacier quartz "
         "thistle beacon saffron tundra marble falcon cedar prism dune coral vapor basalt aurora fern").split()


def system_prompt(g: int, words: int) -> str:
    """A long, group-specific system prompt (distinct from its first characters: the gateway's tree is on text)."""
    rng = random.Random(1000 + g)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[Group {g}] You are assistant number {g}. Follow the house rules below exactly.\n{body}\n"


def workload(groups: int, per_group: int, words: int, seed: int = 0) -> list[tuple[int, str]]:
    prompts = [system_prompt(g, words) for g in range(groups)]
    reqs = [(g, prompts[g] + f"Question {q} for group {g}: name one word from the rules.\nAnswer:")
            for g in range(groups) for q in range(per_group)]
    random.Random(seed).shuffle(reqs)
    return reqs


async def drive(url: str, reqs: list[tuple[int, str]], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    lat, prompt, cached, out, errors = [], 0, 0, 0, 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        async def one(text: str):
            nonlocal prompt, cached, out, errors
            async with sem:
                t0 = time.perf_counter()
                r = await c.post("/generate", json={"text": text, "sampling_params": {
                    "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
                lat.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors += 1
                    return
                m = r.json()["meta_info"]
                prompt += m["prompt_tokens"]
                cached += m["cached_tokens"]
                out += m["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(text) for _, text in reqs))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests_s": len(reqs) / wall, "output_tok_s": out / wall,
            "hit_rate": cached / prompt if prompt else 0.0, "prompt_tokens": prompt, "cached_tokens": cached,
            "p50_latency_s": statistics.median(lat), "errors": errors}


def served(urls: list[str]) -> list[int]:
    counts = []
    for u in urls:
        text = httpx.get(u + "/metrics", timeout=30).text
        counts.append(next(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                           if line.startswith("lmc:num_requests_total{")))
    return counts


def wait_ready(url: str, workers: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ws = httpx.get(url + "/workers", timeout=2).json()["workers"]
            if sum(w["is_healthy"] for w in ws) == workers:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"gateway {url} not ready")


def summarize(runs: list[dict]) -> dict:
    return {key: spread([r[key] for r in runs])
            for key in ("requests_s", "output_tok_s", "hit_rate", "p50_latency_s", "wall_s")}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(result["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, (key, title) in zip(axes, (("requests_s", "throughput (requests/s)"),
                                       ("hit_rate", "prompt tokens from cache"))):
        med = [result["summary"][s][key]["median"] for s in systems]
        lo = [m - result["summary"][s][key]["min"] for s, m in zip(systems, med)]
        hi = [result["summary"][s][key]["max"] - m for s, m in zip(systems, med)]
        bars = ax.bar(systems, med, yerr=[lo, hi], capsize=4, color=["#b0b0b0", "#e3a33b", "#2a7ab9"])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_title(title, fontsize=10)
    w = result["workload"]
    fig.suptitle(f"{w['groups']} groups x {w['per_group']} requests, ~{w['prefix_tokens']}-token shared prefixes; "
                 f"1 core per replica; median of {result['runs']} (min-max)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scale.json"))
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    note = args.note or ("2-core machine shared with other engineers: each replica pinned to one core, the gateway "
                         "and the client share those cores; load averages recorded per run")
    prov = provenance("benchmarks/scale_bench.py", note)

    reqs = workload(args.groups, args.per_group, args.prefix_words)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    plans = plan_replicas(2, device="cpu", cpus=cpus)  # one core, one thread each
    # size the pools: about half of the groups' prefixes, plus room for the requests running at once (their
    # questions and outputs)
    from transformers import AutoTokenizer

    from lmc.runtime.model.loader import resolve

    tok = AutoTokenizer.from_pretrained(resolve(MODEL).tokenizer_dir)
    prefix_tokens = len(tok.encode(system_prompt(0, args.prefix_words)))
    log = tempfile.NamedTemporaryFile("w", prefix="scale_bench_", suffix=".log", delete=False)
    print(f"replica and gateway logs: {log.name}", flush=True)
    pool = prefix_tokens * args.groups // 2 + args.concurrency * (40 + args.max_tokens)
    worker_argv = ["--model", MODEL, "--log-level", "warning", "--enable-metrics", "--max-total-tokens", str(pool)]
    rs = ReplicaSet(plans, worker_argv, port=free_port(), policy="cache_aware", log_file=log,
                    log_level="warning").start()
    urls = rs.replica_urls()
    gateways = {"cache_aware": rs.url}
    extra = []
    try:
        for name, workers in (("round_robin", urls), ("one", urls[:1])):
            port = free_port()
            g = Child(f"gateway {name}", gateway_command("127.0.0.1", port, workers, "round_robin", None,
                                                         ["--log-level", "warn"]), gateway_env(), None)
            g.start(log)
            extra.append(g)
            gateways[name] = f"http://127.0.0.1:{port}"
            wait_ready(gateways[name], len(workers))
        order = ["one", "round_robin", "cache_aware"]
        runs: dict[str, list[dict]] = {s: [] for s in order}
        for i in range(args.runs):
            for system in (order if i % 2 == 0 else order[::-1]):  # alternate the order between runs
                for u in urls:
                    httpx.post(u + "/flush_cache", timeout=60).raise_for_status()
                before = served(urls)
                load0 = os.getloadavg()[0]
                res = asyncio.run(drive(gateways[system], reqs, args.concurrency, args.max_tokens))
                res["per_replica_requests"] = [a - b for a, b in zip(served(urls), before)]
                res["loadavg_1m_before_after"] = [load0, os.getloadavg()[0]]
                res["run"] = i
                runs[system].append(res)
                print(f"run {i} {system:12s} {res['requests_s']:.2f} req/s  hit {res['hit_rate']:.2f}  "
                      f"split {res['per_replica_requests']}  load {load0:.1f}", flush=True)
    finally:
        for g in extra:
            g.signal_group(15)
            g.proc.wait(timeout=30)
        rs.stop()
        log.close()

    summary = {s: summarize(v) for s, v in runs.items()}
    # the best any routing can do: each group's prefix computed once, every other request finds it cached
    total_prompt = runs["one"][0]["prompt_tokens"]
    ideal_hit = (len(reqs) - args.groups) * prefix_tokens / total_prompt
    one = summary["one"]
    result = {
        "benchmark": "scale_bench", "model": MODEL, "runs": args.runs,
        "gateway": "sglang-router " + __import__("importlib.metadata").metadata.version("sglang-router"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "workload": {"groups": args.groups, "per_group": args.per_group, "prefix_tokens": prefix_tokens,
                     "max_tokens": args.max_tokens, "concurrency": args.concurrency, "kv_pool_tokens": pool,
                     "requests": len(reqs), "ideal_hit_rate": ideal_hit},
        "summary": summary,
        "ratios_of_medians": {
            "cache_aware_vs_one_throughput": summary["cache_aware"]["requests_s"]["median"] /
            one["requests_s"]["median"],
            "cache_aware_vs_round_robin_throughput": summary["cache_aware"]["requests_s"]["median"] /
            summary["round_robin"]["requests_s"]["median"],
            "cache_aware_vs_one_hit_rate": summary["cache_aware"]["hit_rate"]["median"] /
            max(1e-9, one["hit_rate"]["median"]),
        },
        "runs_detail": runs,
        "note": note,
        "provenance": finish(prov),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({"summary": summary, "ratios": result["ratios_of_medians"]}, indent=2))


if __name__ == "__main__":
    main()
