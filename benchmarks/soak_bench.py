"""Soak benchmark: tests/test_soak.py's mixed traffic (tests/soak_traffic.py) for minutes against the real server
on loopback, round after round (each round's malformed bodies drawn anew, its regexes never seen before), with the
process's memory (RSS) sampled throughout. Records every wrong outcome, the slot accounting and the warm prefix's
cache hit afterwards, and the compiled-grammar cache's size.

    python benchmarks/soak_bench.py [--duration 600] [--threads 24] [--out benchmarks/results/soak.json]

The server runs in this process (ServerThread), so RSS covers the engine, the server and the clients: a leak in
any shows as growth across rounds. Needs the test dependencies (hypothesis, httpx).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the soak traffic lives with the tests that use it
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KEY = "soak-bench-key"


def python_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def trimmed_rss_mb() -> float:
    """RSS after asking glibc to return its free heap pages: what stays is memory in use, not free memory the
    allocator kept (growth of rss_mb alone may be either)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    return rss_mb()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Sampler(threading.Thread):
    """RSS every `every` seconds: (seconds since start, MB)."""

    def __init__(self, every: float = 2.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.t0, self.stop = every, [], time.monotonic(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((round(time.monotonic() - self.t0, 1), round(rss_mb(), 1)))
            self.stop.wait(self.every)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of rounds (the last round completes)")
    ap.add_argument("--threads", type=int, default=24)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--note", default="", help="what the reader should know about this run (machine load, ...)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "soak.json"))
    args = ap.parse_args()

    import torch

    from lmc.runtime import Engine
    from lmc.server import ServerThread, create_app
    from soak_traffic import Soak, wait_idle

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    sampler = Sampler()
    sampler.start()
    engine = Engine("smollm2-135m-instruct", device=args.device)
    rounds, problems = [], []
    with ServerThread(create_app(engine, api_key=KEY, enable_metrics=True)) as srv:
        soak = Soak(srv.url, KEY, threads=args.threads)
        soak.references()
        warm_prompt, _ = soak.warm_cached()
        rss_after_warmup = rss_mb()
        t0 = time.monotonic()
        seed = 0
        while time.monotonic() - t0 < args.duration:
            report = soak.round(seed)
            rounds.append({"seed": seed, "requests": report.requests, "seconds": round(report.seconds, 2),
                           "problems": len(report.problems), "counts": report.counts, "rss_mb": round(rss_mb(), 1),
                           "rss_after_trim_mb": round(trimmed_rss_mb(), 1), "python_objects": python_objects(),
                           "radix_cached_slots": engine.stats()["cached_slots"]})
            problems += [[str(x)[:300] for x in p] for p in report.problems[:5]]
            r = rounds[-1]
            print(f"round {seed}: {report.requests} requests in {report.seconds:.1f} s, {r['problems']} problems, "
                  f"RSS {r['rss_mb']:.0f} MB ({r['rss_after_trim_mb']:.0f} after malloc_trim), "
                  f"{r['python_objects']} Python objects", flush=True)
            seed += 1
        elapsed = time.monotonic() - t0
        slots = wait_idle(soak.main)
        _, warm_cached = soak.warm_cached()
        grammars = engine.grammars.stats()
        metrics = soak.main.get("/metrics").text
        soak.close()
    sampler.stop.set()
    device = str(engine.device)
    # The KV pool is allocated uninitialised: its pages become resident as slots are first written, so RSS grows
    # towards this size as traffic reaches new slots, and a leak shows as growth past it.
    kv_pool_mb = sum(b.numel() * b.element_size() for b in engine.runner.kv.k + engine.runner.kv.v) / 2**20
    engine.shutdown()  # releases the runner: read what it holds before

    rss = [mb for _, mb in sampler.samples]
    per_round = [r["requests"] / r["seconds"] for r in rounds]
    out = {
        "benchmark": "soak",
        "command": "python benchmarks/soak_bench.py " + " ".join(sys.argv[1:]),
        "note": args.note or "shared, noisy machine: throughput figures are indicative only",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device,
                    "torch_threads": torch.get_num_threads()},
        "kv_pool_mb": round(kv_pool_mb),
        "duration_s": round(elapsed, 1),
        "rounds": len(rounds),
        "requests_total": sum(r["requests"] for r in rounds),
        "requests_by_kind": {k: sum(r["counts"].get(k, 0) for r in rounds) for k in rounds[0]["counts"]},
        "problems_total": sum(r["problems"] for r in rounds),
        "problems_sample": problems[:20],
        "requests_per_s": {"median": round(statistics.median(per_round), 2), "min": round(min(per_round), 2),
                           "max": round(max(per_round), 2)},
        "rss_mb": {"after_warmup": round(rss_after_warmup, 1), "first_round": rounds[0]["rss_mb"],
                   "last_round": rounds[-1]["rss_mb"], "max": max(rss),
                   "after_trim_first_round": rounds[0]["rss_after_trim_mb"],
                   "after_trim_last_round": rounds[-1]["rss_after_trim_mb"], "samples": sampler.samples},
        "python_objects": {"first_round": rounds[0]["python_objects"], "last_round": rounds[-1]["python_objects"]},
        "slots_after": slots,
        "no_request_owned_slot": slots["consistent"] and slots["request_owned_slots"] == 0,
        "warm_prefix": {"prompt_tokens": warm_prompt, "cached_tokens_after": warm_cached},
        "grammar_cache": grammars,
        "bad_requests_counted": float(next(line.split()[-1] for line in metrics.splitlines()
                                           if line.startswith("lmc:num_bad_requests_total"))),
        "per_round": rounds,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("per_round", "rss_mb", "problems_sample")}, indent=1))
    print(f"RSS MB: after warm-up {out['rss_mb']['after_warmup']}, first round {out['rss_mb']['first_round']}, "
          f"last round {out['rss_mb']['last_round']}, max {out['rss_mb']['max']}")
    return 0 if out["problems_total"] == 0 and out["no_request_owned_slot"] else 1


if __name__ == "__main__":
    sys.exit(main())
