"""Prometheus metrics in the text exposition format (no client library needed).

Names follow SGLang's collector with the `lmc:` prefix (ecosystem notes 3.6): gauges for the queue, running
requests, KV token usage, cache hit rate and generation throughput; counters for tokens and requests; histograms
for time to first token (streamed requests), inter-token latency and end-to-end latency; the compiled-grammar
cache (entries, bytes, compilations, evictions, timeouts). Every series carries the `model_name` label. Some
gauges are repeated under vLLM's and SGLang's names (GAUGE_ALIASES).
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import deque

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# The same gauges under the names other schedulers read: Kubernetes gateways (llm-d, the Gateway API inference
# extension) score pods by vLLM's names, SGLang's tooling by `sglang:`. vLLM's `*_perc` gauges are fractions (0-1).
GAUGE_ALIASES = {
    "num_queue_reqs": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "num_running_reqs": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "token_usage": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "sglang:token_usage"),
    "num_used_tokens": ("sglang:num_used_tokens",),
    "max_total_num_tokens": ("sglang:max_total_num_tokens",),
    "cache_hit_rate": ("sglang:cache_hit_rate",),
    "gen_throughput": ("sglang:gen_throughput",),
}


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    WINDOW = 10.0  # seconds over which gen_throughput is averaged

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "cached_tokens_total": 0,
                         "num_requests_total": 0, "num_so_requests_total": 0, "num_aborted_requests_total": 0,
                         "num_bad_requests_total": 0, "jump_forward_tokens_total": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._recent: deque[tuple[float, int]] = deque()  # (finish time, generated tokens)

    def bad_request(self) -> None:
        with self._lock:
            self.counters["num_bad_requests_total"] += 1

    def finished(self, meta: dict, start: float, structured: bool = False, first_token: float | None = None) -> None:
        now = time.perf_counter()
        gen = int(meta.get("completion_tokens") or 0)
        with self._lock:
            c = self.counters
            c["num_requests_total"] += 1
            c["prompt_tokens_total"] += int(meta.get("prompt_tokens") or 0)
            c["generation_tokens_total"] += gen
            c["cached_tokens_total"] += int(meta.get("cached_tokens") or 0)
            c["jump_forward_tokens_total"] += int(meta.get("jump_forward_tokens") or 0)
            c["num_so_requests_total"] += int(structured)
            if (meta.get("finish_reason") or {}).get("type") == "abort":
                c["num_aborted_requests_total"] += 1
            self.e2e.observe(now - start)
            if first_token is not None:
                self.ttft.observe(first_token - start)
                if gen > 1:
                    self.itl.observe((now - first_token) / (gen - 1))
            self._recent.append((now, gen))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.WINDOW:
            self._recent.popleft()

    def throughput(self) -> float:
        now = time.perf_counter()
        with self._lock:
            self._trim(now)
            return sum(g for _, g in self._recent) / self.WINDOW

    def render(self, engine_stats: dict, slots: dict, grammars: dict | None = None) -> str:
        """The exposition text. `grammars`: GrammarCache.stats()."""
        labels = f'model_name="{self.model_name}"'
        total = max(1, slots["total_slots"])
        used = slots["total_slots"] - slots["free_slots"] - slots["evictable_slots"]
        prompt = engine_stats.get("prompt_tokens", 0)
        gauges = {
            "num_running_reqs": ("Requests running (decoding or being prefilled).", engine_stats.get("running", 0)),
            "num_queue_reqs": ("Requests waiting to be scheduled.", engine_stats.get("waiting", 0)),
            "num_used_tokens": ("KV slots in use (not free, not evictable cache).", used),
            "token_usage": ("Fraction of the KV pool in use.", used / total),
            "max_total_num_tokens": ("KV pool size in tokens.", slots["total_slots"]),
            "cache_hit_rate": ("Prompt tokens served from the prefix cache / prompt tokens (since start).",
                               engine_stats.get("cached_tokens", 0) / prompt if prompt else 0.0),
            "gen_throughput": (f"Generated tokens per second over the last {self.WINDOW:.0f} s.", self.throughput()),
            "cached_slots": ("KV slots held by the radix cache.", slots["cached_slots"]),
        }
        g = grammars or {}
        gauges.update({
            "grammar_cache_entries": ("Compiled grammars cached (LRU).", g.get("entries", 0)),
            "grammar_cache_bytes": ("Memory of the cached grammars (xgrammar's estimate).", g.get("bytes", 0)),
            "grammar_compiles_running": ("Grammar compilations running (timed-out ones included).",
                                         g.get("compiling", 0)),
        })
        grammar_counters = {
            "grammar_compiles_total": ("Grammars compiled.", g.get("compiles", 0)),
            "grammar_cache_evictions_total": ("Compiled grammars evicted from the cache.", g.get("evictions", 0)),
            "grammar_compile_timeouts_total": ("Requests refused because their grammar compiled too long.",
                                               g.get("timeouts", 0)),
        }
        helps = {
            "prompt_tokens_total": "Prompt tokens of finished requests.",
            "generation_tokens_total": "Generated tokens of finished requests.",
            "cached_tokens_total": "Prompt tokens of finished requests served from the prefix cache.",
            "num_requests_total": "Finished requests.",
            "num_so_requests_total": "Finished structured-output (regex / JSON schema / EBNF) requests.",
            "num_aborted_requests_total": "Requests the engine aborted.",
            "num_bad_requests_total": "Requests refused with a 4xx.",
            "jump_forward_tokens_total": "Tokens placed by jump-forward decoding without sampling.",
        }
        lines = []
        for name, (help_, value) in gauges.items():
            lines += [f"# HELP lmc:{name} {help_}", f"# TYPE lmc:{name} gauge", f"lmc:{name}{{{labels}}} {value}"]
            for alias in GAUGE_ALIASES.get(name, ()):
                lines += [f"# HELP {alias} Alias of lmc:{name}.", f"# TYPE {alias} gauge",
                          f"{alias}{{{labels}}} {value}"]
        for name, (help_, value) in grammar_counters.items():
            lines += [f"# HELP lmc:{name} {help_}", f"# TYPE lmc:{name} counter", f"lmc:{name}{{{labels}}} {value}"]
        with self._lock:
            for name, value in self.counters.items():
                lines += [f"# HELP lmc:{name} {helps[name]}", f"# TYPE lmc:{name} counter",
                          f"lmc:{name}{{{labels}}} {value}"]
            for name, help_, h in (
                    ("time_to_first_token_seconds", "Time to first token (streamed requests).", self.ttft),
                    ("inter_token_latency_seconds", "Mean time between output tokens (streamed requests).",
                     self.itl),
                    ("e2e_request_latency_seconds", "End-to-end request latency.", self.e2e)):
                lines += [f"# HELP lmc:{name} {help_}", f"# TYPE lmc:{name} histogram", *h.lines(f"lmc:{name}",
                                                                                                  labels)]
        return "\n".join(lines) + "\n"
