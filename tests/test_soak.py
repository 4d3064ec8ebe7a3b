"""Soak test: the real server (`lmc serve`'s app on loopback, the module's `server` fixture) under a few hundred
requests from 24 threads, mixing normal, streamed, aborted-mid-stream, hostile (tests/hostile_requests.py) and
hypothesis-generated malformed requests (tests/soak_traffic.py). Afterwards: every normal request got the same
full answer as alone at temperature 0, every malformed one a 4xx with a message, no KV slot is left owned by a
request, and the warm prefix is still cached.

benchmarks/soak_bench.py is the long version (minutes, thousands of requests, memory sampled)."""
import time

from conftest import API_KEY as KEY
from soak_traffic import Soak, wait_idle


def test_soak_mixed_traffic(server):
    t0 = time.monotonic()
    soak = Soak(server.url, KEY, repeats=3, aborts=16)
    soak.references()
    print(f"soak: references in {time.monotonic() - t0:.1f} s")
    prompt_tokens, _ = soak.warm_cached()
    report = soak.round(seed=0)
    print(f"soak: {report.requests} requests in {report.seconds:.1f} s: {report.counts}")
    assert not report.problems, report.problems[:5]
    assert report.requests >= 300 and report.counts["malformed"] >= 100
    slots = wait_idle(soak.main)
    assert slots["consistent"] and slots["request_owned_slots"] == 0 and slots["resident_requests"] == 0, slots
    assert slots["protected_slots"] == 0 and slots["free_slots"] + slots["cached_slots"] == slots["total_slots"]
    _, cached = soak.warm_cached()
    soak.close()
    assert cached >= prompt_tokens - 1  # the warm prefix survived the soak
