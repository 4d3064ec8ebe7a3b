"""Overlap scheduling (scheduler/scheduler.py) never changes outputs: an engine that processes step N while step
N+1 runs (its forward on the CPU worker thread, its decode inputs gathered from the device token buffer) gives the
same greedy tokens and logprobs as an engine without overlap (the session engine on the CPU), with stop strings, regex
constraints and jump-forward, seeded sampling and penalties, aborts, a tiny KV pool (eviction, chunked prefill,
retraction) and faults inside a step. The overlap engines check the slot accounting after every step."""
import threading
import time
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constrained_corpus import chat
from lmc.runtime import Engine, EngineError

TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries merchants "
        "built warehouses, bridges and a cathedral, and the town grew into a center of trade and learning.")


@pytest.fixture(scope="module")
def tight():
    """Overlap on a KV pool of 160 slots, 16-token prefill chunks and at most 6 running requests."""
    eng = Engine(max_total_tokens=160, chunked_prefill_size=16, max_running_requests=6, check_invariants=True,
                 overlap_schedule=True)
    yield eng
    eng.shutdown()


def both(plain, overlapped, prompts, params, **opts):
    got = overlapped.generate(prompts, params, **opts)
    want = plain.generate(prompts, params, **opts)
    assert overlapped.scheduler.overlap and not plain.scheduler.overlap
    return got, want


def test_greedy_outputs_with_stops_and_constraints_match(plain, overlapped):
    prompts = [chat("Name three rivers."), chat("Write a haiku about tea."), "The capital of France is",
               chat("Give a person as JSON."), chat("Count from one to ten."), chat("Reply with an email address."),
               "1, 2, 3, 4,", chat("Describe a clock in one sentence.")]
    params = [{"max_new_tokens": 40, "temperature": 0, "stop": ["\n\n", "."]},
              {"max_new_tokens": 24, "temperature": 0},
              {"max_new_tokens": 12, "temperature": 0, "stop": [" is"], "min_new_tokens": 2},
              {"max_new_tokens": 40, "temperature": 0, "regex": r'\{"name": "[A-Za-z ]{1,12}", "age": [0-9]{1,2}\}'},
              {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": [30]},
              {"max_new_tokens": 20, "temperature": 0, "regex": r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"},
              {"max_new_tokens": 1, "temperature": 0},
              {"max_new_tokens": 16, "temperature": 0, "json_schema": {"type": "object", "properties": {
                  "ticks": {"type": "integer"}}, "required": ["ticks"]}}]
    jumps = overlapped.stats()["jumps"]
    got, want = both(plain, overlapped, prompts, params)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"] and g["text"] == w["text"]
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
    assert overlapped.stats()["jumps"] > jumps, "no jump-forward ran under overlap"


def test_logprobs_seeds_and_penalties_match(plain, overlapped):
    prompts = ["Once upon a time", "A list of fruits:", "The weather today"]
    params = [{"max_new_tokens": 10, "temperature": 0.9, "seed": 7},
              {"max_new_tokens": 10, "temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
              {"max_new_tokens": 0}]
    got, want = both(plain, overlapped, prompts, params, return_logprob=True, logprob_start_len=0,
                     top_logprobs_num=2)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            a = [lp for lp, _, _ in g["meta_info"][key] if lp is not None]
            b = [lp for lp, _, _ in w["meta_info"][key] if lp is not None]
            assert a == pytest.approx(b, abs=1e-4)


def test_steps_overlap_and_stale_entries_are_dropped(overlapped):
    """A request that ends on a stop token in step N also sits in the in-flight step N+1 (its end was not known
    when N+1 was scheduled): that entry is dropped, and the request ends with exactly its output."""
    stale = overlapped.stats()["stale_entries"]
    out = overlapped.generate([chat(f"Say the word {w}.") for w in ("yes", "no", "maybe")],
                              {"max_new_tokens": 60, "temperature": 0})
    stopped = [o for o in out if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped and all(o["output_ids"][-1] == o["meta_info"]["finish_reason"]["matched"] for o in stopped)
    assert overlapped.stats()["stale_entries"] > stale


def test_abort_while_a_step_is_in_flight(overlapped):
    fut = overlapped.submit(TEXT, {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True})
    deadline = time.monotonic() + 60
    while overlapped.stats()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    overlapped.abort(fut.rid)
    res = fut.result(timeout=60)
    assert res["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(res["output_ids"]) < 4000
    again = overlapped.generate(TEXT, {"max_new_tokens": 2, "temperature": 0})  # its prefix was cached
    assert again["meta_info"]["cached_tokens"] > 0
    s = overlapped.stats()
    assert s["free_slots"] + s["cached_slots"] == s["total_slots"]


request_mix = st.lists(st.tuples(st.integers(0, 30), st.integers(4, 40), st.integers(1, 10)), min_size=1,
                       max_size=7)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(mix=request_mix, policy=st.sampled_from(["lpm", "dfs-weight", "fcfs"]))
def test_random_mixes_under_a_tiny_pool(tight, plain, tokenizer, mix, policy):
    """Eviction, chunked prefill and retraction with steps in flight: the slot accounting holds after every step
    (check_invariants) and the greedy outputs are the session engine's."""
    base = tokenizer.encode(TEXT)
    tight.scheduler.cfg.policy = policy
    prompts = [base[s:s + n] for s, n, _ in mix]
    params = [{"max_new_tokens": k, "temperature": 0, "ignore_eos": True} for _, _, k in mix]
    got = tight.generate(input_ids=prompts, sampling_params=params)
    want = plain.generate(input_ids=prompts, sampling_params=params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    s = tight.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["free_slots"] + s["cached_slots"] == s["total_slots"]


def test_retraction_with_steps_in_flight(tight, plain, tokenizer):
    tight.scheduler.cfg.policy = "lpm"
    base = tokenizer.encode(TEXT)
    before = tight.stats()["retractions"]
    prompts = [base[i:i + 12] for i in range(6)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    got = tight.generate(input_ids=prompts, sampling_params=params)
    want = plain.generate(input_ids=prompts, sampling_params=params)
    assert tight.stats()["retractions"] > before
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


class DeviceFault:
    """Test double around ModelRunner.launch: the device work of a batch holding a poisoned request fails, so the
    error surfaces at collect() (as an error on the worker thread or the GPU stream does), after the next step
    was launched."""

    def __init__(self, launch, poisoned):
        self.launch, self.poisoned, self.raised = launch, poisoned, 0
        self.lock = threading.Lock()

    def __call__(self, sb):
        h = self.launch(sb)
        if any(self.poisoned(r, sb) for r in sb.reqs):
            with self.lock:
                self.raised += 1
            h.forward.result()  # let the real work finish first: its writes must not race the redo
            failed: Future = Future()
            failed.set_exception(RuntimeError("injected device-work fault"))
            h.forward = failed
        return h


def test_a_fault_surfacing_at_collect_fails_only_the_blamed_request(overlapped, plain, tokenizer, monkeypatch):
    prompts = [f"Step {i}: the list of prime numbers begins" for i in range(4)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = [r["output_ids"] for r in plain.generate(prompts, params)]
    ids = tokenizer.encode(prompts[1])
    fault = DeviceFault(overlapped.runner.launch,
                        lambda r, sb: r.input_ids == ids and sb.is_decode and len(r.output_ids) >= 4)
    monkeypatch.setattr(overlapped.runner, "launch", fault)
    out = overlapped.generate(prompts, params)
    monkeypatch.undo()
    assert "injected device-work fault" in out[1]["error"] and fault.raised >= 1
    assert [out[i]["output_ids"] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    again = overlapped.generate(prompts[1], params)
    assert again["output_ids"] == alone[1]
    with pytest.raises(EngineError):  # the blamed request alone, through the future API
        monkeypatch.setattr(overlapped.runner, "launch", DeviceFault(overlapped.runner.launch,
                                                                     lambda r, sb: r.input_ids == ids))
        overlapped.submit(input_ids=ids, sampling_params=params).result(timeout=120)
    monkeypatch.undo()


def test_fork_branches_reuse_the_commit_in_flight(overlapped):
    """With overlap the branches deferred behind their commit are scheduled while the commit's forward is still in
    flight, before its KV enters the tree: they borrow its slots (scheduler/cache.SharedBlock) instead of
    recomputing the shared prompt, so every branch counts it as cached."""
    from test_in_batch_sharing import fork_branches

    cached, _, n_prompt = fork_branches(overlapped)
    assert all(c >= n_prompt for c in cached[1:]), (cached, n_prompt)


def test_chains_and_their_forks_match(plain, overlapped):
    """Engine-side continuation under overlap: a compiled program's chains (a select scored by ids, a fork whose
    branches are child requests of the chain, spawned while the next step is in flight) give the outputs of the
    engine without overlap, and leave no KV behind."""
    import lmc
    from test_continuation import gen_then_fork, nested

    for program in (gen_then_fork, nested):
        compiled = program.compile()
        got, want = (compiled.run(topic="the sea", backend=lmc.Local(engine=e), temperature=0) for e in
                     (overlapped, plain))
        assert got.error() is None and got.variables() == want.variables() and got.text() == want.text()
    assert overlapped.stats()["forked_branches"] >= 6
    assert overlapped.load()["request_owned_slots"] == 0 and not overlapped.scheduler.forking


def test_a_call_boundary_launches_the_next_call_without_an_empty_step(overlapped, monkeypatch):
    """A chain whose gens end at max_tokens (known before their last token is): the step that collects a gen's last
    token launches the chain's next call itself, so the instance takes one step per forward plus the last collect
    (before, each of chain6's 6 boundaries cost a step that launched nothing while the device idled)."""
    import lmc
    from programs_support import chain

    sched, steps = overlapped.scheduler, []
    step = sched.step
    monkeypatch.setattr(sched, "step", lambda: steps.append(1) or step())
    forwards = sched.stats["forwards"]
    state = chain.compile().run(topic="the moon", backend=lmc.Local(engine=overlapped), temperature=0)
    assert state.error() is None
    forwards = sched.stats["forwards"] - forwards
    assert forwards >= 13 and len(steps) == forwards + 1, (len(steps), forwards)


def test_forks_of_many_instances_on_a_tiny_engine(tight, plain):
    """12 instances forking 2 branches each after a gen, on an engine of 6 running requests and a pool of 160
    slots (eviction, retraction): all finish, with the outputs of the roomy engine, and leave no KV behind."""
    import lmc
    from test_continuation import gen_then_fork

    compiled, topics = gen_then_fork.compile(), [{"topic": f"the number {i}"} for i in range(12)]
    done, forked = [], tight.stats()["forked_branches"]
    worker = threading.Thread(target=lambda: done.append(compiled.run_batch(topics, backend=lmc.Local(engine=tight),
                                                                            temperature=0)), daemon=True)
    worker.start()
    worker.join(300)
    assert done, "the instances did not finish"
    assert tight.stats()["forked_branches"] - forked == 24  # every fork: the engine's child requests
    want = compiled.run_batch(topics, backend=lmc.Local(engine=plain), temperature=0)
    assert [s.variables() for s in done[0]] == [s.variables() for s in want]
    assert tight.load()["request_owned_slots"] == 0 and not tight.scheduler.forking
