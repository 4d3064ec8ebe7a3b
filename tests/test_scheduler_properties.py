"""The scheduler under pressure: random request mixes on a tiny KV pool (eviction, chunked prefill, retraction)
must keep the slot accounting invariant after every step (the engine checks it) and give every request the same
greedy output as an unconstrained engine."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc.protocol.hints import ProgramHints
from lmc.runtime import Engine

BASE = ("The history of the city begins with a small fishing village on the river. Over the centuries merchants "
        "built warehouses, bridges and a cathedral, and the town grew into a center of trade and learning.")


@pytest.fixture(scope="module")
def tight():
    """A KV pool of 160 slots, 16-token prefill chunks and at most 6 running requests."""
    eng = Engine(max_total_tokens=160, chunked_prefill_size=16, max_running_requests=6, check_invariants=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def base_ids(tokenizer):
    return tokenizer.encode(BASE)


request_mix = st.lists(
    st.tuples(st.integers(0, 30), st.integers(4, 40), st.integers(1, 10)),  # (start, length, new tokens)
    min_size=1, max_size=7)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(mix=request_mix, policy=st.sampled_from(["program", "lpm", "dfs-weight", "fcfs", "random"]))
def test_random_mixes_under_a_tiny_pool(tight, engine, base_ids, mix, policy):
    """Program hints on every request: under `program` they engage forward shaping (budgeted prefills that the
    running requests decode in); the other policies ignore them."""
    tight.scheduler.cfg.policy = policy
    prompts = [base_ids[s:s + n] for s, n, _ in mix]
    params = [{"max_new_tokens": k, "temperature": 0, "ignore_eos": True} for _, _, k in mix]
    hints = ProgramHints("mix", tokens_left=sum(k for _, _, k in mix))
    got = tight.generate(input_ids=prompts, sampling_params=params, program=hints)
    want = engine.generate(input_ids=prompts, sampling_params=params)
    for g, w in zip(got, want):
        assert "error" not in g, g.get("error")
        assert g["output_ids"] == w["output_ids"]
    s = tight.stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["free_slots"] + s["cached_slots"] == s["total_slots"]


def test_retraction_resumes_with_the_same_result(tight, engine, base_ids):
    """Six long generations cannot all fit 160 slots: decode must retract and later resume them."""
    tight.scheduler.cfg.policy = "lpm"
    before = tight.stats()["retractions"]
    prompts = [base_ids[i:i + 12] for i in range(6)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    got = tight.generate(input_ids=prompts, sampling_params=params)
    want = engine.generate(input_ids=prompts, sampling_params=params)
    assert tight.stats()["retractions"] > before
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_chunked_prefill_of_a_long_prompt(tight, engine, base_ids):
    ids = base_ids[:100]
    params = {"max_new_tokens": 4, "temperature": 0}
    got = tight.generate(input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=0)
    want = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=0)
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["forward_passes"] >= 100 // 16
    a = [lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]]
    b = [lp for lp, _, _ in want["meta_info"]["input_token_logprobs"][1:]]
    assert a == pytest.approx(b, abs=1e-4)


def test_request_larger_than_the_pool_is_aborted_alone(tight, base_ids):
    params = [{"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}, {"max_new_tokens": 3}]
    got = tight.generate(input_ids=[base_ids[:20], base_ids[:10]], sampling_params=params)
    assert got[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "KV cache" in got[0]["meta_info"]["finish_reason"]["message"]
    assert len(got[1]["output_ids"]) == 3
