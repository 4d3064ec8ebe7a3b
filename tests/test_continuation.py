"""Engine-side continuation (lmc.runtime.continuation, lmc.compiler.chain), on the session engine: a compiled
program's run of gens and selects between host breaks is one engine request, and gives what the call-by-call
run gives at temperature 0 (stop strings, max tokens, a regex, selects scored by token ids and by choice
children, selects fused with the gen after them, in a small forward by ids too, forks); each call's result
streams as it finishes; a malformed chain is refused naming the step; an aborted chain gives up its KV; a select
scored by ids shares its prompt with the requests queued behind it at once. A fork after a chain's call spawns its
branches as child requests in the same step (no forward lost while other work runs), with the same outputs
under every policy, continuation on and off; aborting the instance frees its branches, and a failing branch
fails its instance alone."""
import asyncio
import re
import threading

import pytest

import lmc
from lmc.protocol import token_length_normalized, unconditional_likelihood_normalized
from lmc.runtime import EngineError, RequestError, continuation

from doubles import FaultyForward
from programs_support import chain


@lmc.function
def mixed(s, topic):
    s += "Topic: " + topic + "\nFact:" + lmc.gen("fact", max_tokens=8, stop="\n")
    s += "\nIs it true? " + lmc.select("true", choices=["yes", "no"])  # multi-token: scored by children
    s += "\nI rate it " + lmc.select("score", choices=["1", "2", "3", "4", "5"])  # one token id each
    s += " out of 5.\nYear:" + lmc.gen("year", max_tokens=6, regex=r" [0-9]{4}")
    s += "\nIn one word:" + lmc.gen("word", max_tokens=3)  # ends on max tokens


@lmc.function
def forked(s, topic):
    s += lmc.user("Rate " + topic + ".")
    forks = s.fork(2)
    for k, f in enumerate(forks):
        f += lmc.assistant(f"Take {k}: I give it " + lmc.select("score", choices=["1", "2", "3"])
                           + " because" + lmc.gen("why", max_tokens=5, stop="."))
    forks.join()
    s += lmc.user("Summary?") + lmc.assistant(lmc.gen("summary", max_tokens=5))


@lmc.function
def gen_then_fork(s, topic):
    s += "Topic: " + topic + "\nFact:" + lmc.gen("fact", max_tokens=4, stop="\n")
    forks = s.fork(2)
    for k, f in enumerate(forks):
        f += f"\nIdea {k}:" + lmc.gen("idea", max_tokens=3 + 3 * k)
        f += "\nGood? " + lmc.select("good", choices=["yes", "no"])
    forks.join()
    s += "\nBest:" + lmc.gen("best", max_tokens=3)


@lmc.function
def nested(s, topic):
    # a fork in each branch, after its gen: the short plan's solutions start while the long plan still decodes
    s += "Topic: " + topic + "\n"
    plans = s.fork(2)
    for i, f in enumerate(plans):
        f += f"Plan {i}:" + lmc.gen("plan", max_tokens=2 + 4 * i, ignore_eos=True)
        sols = f.fork(2)
        for j, g in enumerate(sols):
            g += f"\nSolution {j}:" + lmc.gen("solution", max_tokens=6 - 4 * i, ignore_eos=True)
        sols.join()
    plans.join()


@lmc.function
def fused(s, topic):
    # choices of several tokens: scored by one child request each (a single-token choice is scored by ids, unfused)
    s += "Topic: " + topic + "\nIs it round? " + lmc.select("round", choices=["yes, it is", "no, it is not"])
    s += "\nColour:" + lmc.gen("colour", max_tokens=4, stop="\n")
    s += "\nIs it big? " + lmc.select("big", choices=["yes, it is", "no, it is not"])
    s += "\nOne word:" + lmc.gen("word", max_tokens=1)  # ends on the token its select's winning child sampled
    s += "\nIs it far? " + lmc.select("far", choices=["yes", "no"])
    s += "\nYear:" + lmc.gen("year", max_tokens=6, regex=r" [0-9]{4}")  # constrained: not fused


class CountedEnqueues:
    """Test double around Engine._enqueue_batch: counts the requests that reach the engine's inbox (a chain's
    select children are the scheduler's own and never do)."""

    def __init__(self, engine):
        self.engine, self.count, self.real = engine, 0, engine._enqueue_batch

    def __call__(self, batch, loop=None):
        self.count += len(batch)
        return self.real(batch, loop)


@pytest.fixture
def local(engine, monkeypatch):
    counted = CountedEnqueues(engine)
    monkeypatch.setattr(engine, "_enqueue_batch", counted)
    yield lmc.Local(engine=engine), counted
    engine.enable_continuation = True


def _run(program, be, engine, continuation: bool, **args):
    engine.enable_continuation = continuation
    state = program.compile().run(**args, backend=be, temperature=0)
    assert state.error() is None
    return state


def test_static_chain_is_one_request_and_matches_call_by_call(local, engine):
    be, counted = local
    before = engine.stats()["continuations"]
    off = _run(mixed, be, engine, False, topic="the moon")
    assert engine.stats()["continuations"] == before
    counted.count = 0
    on = _run(mixed, be, engine, True, topic="the moon")
    assert counted.count == 1  # the whole static program: one engine request
    assert engine.stats()["continuations"] - before == 4  # 5 calls, 4 boundaries
    assert on.variables() == off.variables() and on.text() == off.text()
    assert len(on["year"]) == 5 and on["year"][1:].isdigit()  # the regex held across the boundary
    ids = {on.get_meta_info(k)["id"] for k in ("fact", "year", "word")}
    assert len(ids) == 1
    assert on.get_meta_info("word")["completion_tokens"] == 3
    assert on.get_meta_info("word")["cached_tokens"] > 0  # its prefix stayed in the request's KV
    assert on.get_meta_info("score")["normalized_prompt_logprobs"] == pytest.approx(
        off.get_meta_info("score")["normalized_prompt_logprobs"], abs=1e-3)
    usage = lmc.backend.openai.program_usage(on)
    assert usage.calls == 5 and usage.completion_tokens > 0


def test_forks_run_a_chain_per_branch_and_match(local, engine):
    be, counted = local
    off = _run(forked, be, engine, False, topic="bread")
    counted.count = 0
    on = _run(forked, be, engine, True, topic="bread")
    # one chain per branch and the gen after the join; no prefill hint for the fork's text: the local engine
    # shares a prefix's computation among the requests of one batch (Fork.prefill)
    assert counted.count == 3
    assert on.variables() == off.variables() and on.text() == off.text()
    assert on.messages() == off.messages()


def test_select_fused_with_the_next_gen_matches_call_by_call(local, engine):
    be, counted = local
    off = _run(fused, be, engine, False, topic="the sun")
    before = engine.stats()["fused_selects"]
    counted.count = 0
    children = []  # (prompt logprobs recorded, positions from the first to the choice's end, prompt length)
    engine.scheduler.on_call_end = lambda r, reason: r.logprob_end is not None and children.append(
        (len(r.input_logprobs), r.logprob_end - r.logprob_start, len(r.input_ids)))
    try:
        on = _run(fused, be, engine, True, topic="the sun")
    finally:
        engine.scheduler.on_call_end = None
    assert counted.count == 1
    assert engine.stats()["fused_selects"] - before == 2  # round -> colour, big -> word; not far -> the regex
    # each fused child's prompt logprobs stop after its choice: none over the gen's text it prefills on into
    assert len(children) == 4 and all(got == want and want < n for got, want, n in children)
    assert on.variables() == off.variables() and on.text() == off.text()
    assert on.get_meta_info("word")["completion_tokens"] == 1
    for name in ("round", "big", "far"):  # scored from the same positions as the unfused select
        assert on.get_meta_info(name)["normalized_prompt_logprobs"] == pytest.approx(
            off.get_meta_info(name)["normalized_prompt_logprobs"], abs=1e-3)
    # a fused child's sampled token is the gen's first, counted there once: a select generates nothing either way
    assert lmc.backend.openai.program_usage(on).completion_tokens == \
        lmc.backend.openai.program_usage(off).completion_tokens


def _forwards(program, be, engine, **args):
    assert engine.flush_cache()
    before = engine.stats()
    state = _run(program, be, engine, True, **args)
    after = engine.stats()
    return state, after["forwards"] - before["forwards"], after["fused_selects"] - before["fused_selects"]


def test_select_by_ids_is_fused_in_a_small_forward(local, engine, monkeypatch):
    """Latency fusion: a select of single tokens followed by a greedy gen is fused too where nothing is queued
    and the forward stays small, one forward fewer per such select, with the same outputs and select logprobs;
    not where its children would compute more than LATENCY_FUSE_TOKENS, nor where another request waits."""
    be, _ = local
    off = _run(chain, be, engine, False, topic="the moon")
    on, forwards, fused = _forwards(chain, be, engine, topic="the moon")
    assert fused == 2  # true0 -> fact1, true1 -> fact2; not true2, the last call
    assert on.variables() == off.variables() and on.text() == off.text()
    for name in ("true0", "true1", "true2"):
        assert on.get_meta_info(name)["normalized_prompt_logprobs"] == pytest.approx(
            off.get_meta_info(name)["normalized_prompt_logprobs"], abs=1e-3)
    monkeypatch.setattr(continuation, "LATENCY_FUSE_TOKENS", 0)
    by_ids, unfused_forwards, fused = _forwards(chain, be, engine, topic="the moon")
    assert fused == 0 and by_ids.variables() == on.variables()
    assert unfused_forwards - forwards == 2
    monkeypatch.undo()
    before = engine.stats()["fused_selects"]
    states = chain.compile().run_batch([{"topic": "the moon"}] * 2, backend=be, temperature=0)
    # the two instances reach their first select in one forward: the second finds the first's children queued
    assert engine.stats()["fused_selects"] - before < 4
    assert all(st.variables() == off.variables() for st in states)


def test_select_of_single_tokens_is_scored_by_ids_without_the_plans_ids(engine):
    """A plan lowered for an endpoint carries no token ids (what /v1/programs receives): the engine finds that
    each choice is one token after the text and scores them all in one forward, as select_tokens would, with
    the decision and logprobs of the per-choice requests."""
    text = "Question: is a lemon sour?\nOn a scale of 1 to 5, I rate it "
    choices = ["1", "2", "3", "4", "5"]
    step_by_step = asyncio.run(lmc.Local(engine=engine).select(text, choices, 0.0, token_length_normalized))
    steps = [{"text": text, "choices": choices, "method": token_length_normalized}]

    async def run():
        async for item in engine.async_chain(steps):
            pass
        return item

    assert engine.flush_cache()  # the prompt is computed afresh: children would need two forwards
    before = engine.stats()
    final = asyncio.run(run())
    after = engine.stats()
    assert after["forwards"] - before["forwards"] == 1  # no choice children: they would take a second forward
    assert after["continuations"] == before["continuations"]
    seg = final["segments"][0]
    assert seg["text"] == step_by_step.decision
    assert seg["meta_info"]["normalized_prompt_logprobs"] == pytest.approx(
        step_by_step.meta_info["normalized_prompt_logprobs"], abs=1e-3)


def test_each_call_streams_as_it_finishes(engine):
    g = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    steps = [{"text": "Count: one, two,", "gen": g},
             {"text": "\nAgain? ", "choices": ["yes", "no"], "method": token_length_normalized},
             {"text": "\nMore:", "gen": g}]
    seen = []  # (segment index, whether the final result was already out)

    async def consume():
        async for item in engine.async_chain(steps):
            seen.append(item.get("index", "end"))
        return item

    final = asyncio.run(consume())
    assert seen == [0, 1, 2, "end"]
    assert [s["kind"] for s in final["segments"]] == ["gen", "select", "gen"]
    assert final["segments"][1]["text"] in ("yes", "no") and final["stopped_at"] is None
    step_by_step = engine.generate("Count: one, two,", g)["text"]
    assert final["segments"][0]["text"] == step_by_step


@pytest.mark.parametrize("steps, message", [
    ([], "non-empty list"),
    ([{"text": "a", "gen": {}, "choices": ["x"]}], "chain step 0: set exactly one of gen"),
    ([{"text": "a", "gen": {"max_new_tokens": 2}}, {"text": "b", "gen": {"temperature": -1}}],
     "chain step 1: invalid sampling parameter temperature"),
    ([{"text": "a", "choices": ["x", "y"], "token_ids": [1], "method": token_length_normalized}],
     "chain step 0: token_ids"),
    ([{"text": "a", "choices": ["x"], "method": unconditional_likelihood_normalized}], "chain step 0: method"),
    ([{"text": "a", "choices": []}], "chain step 0: choices"),
    ([{"text": "", "gen": {}}], "chain step 0: its text is the prompt"),
    ([{"text": "a", "gen": {}, "speed": 3}], "unknown field(s): ['speed']"),
    ([{"text": "a", "gen": {}}, {"text": "", "branches": [[{"text": "b", "gen": {}},
                                                           {"text": "", "branches": [[{"text": "c", "gen": {}}]]}]]}],
     "chain step 1 branch 0 step 1: a fork is a chain's last step"),
    ([{"text": "a", "gen": {}}, {"text": "", "branches": []}], "chain step 1: branches must be"),
    ([{"text": "a", "gen": {}}, {"text": "", "branches": [[{"text": "b", "gen": {"top_k": -5}}]]}],
     "chain step 1 branch 0 step 0: invalid sampling parameter top_k"),
    (["a"], "chain step 0: must be a ChainStep"),
])
def test_malformed_chain_is_refused_naming_the_step(engine, steps, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        engine.submit_chain(steps).result()


def test_aborted_chain_gives_up_its_kv(engine):
    first = threading.Event()
    steps = [{"text": "Once upon a time", "gen": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}},
             {"text": " and then", "gen": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}]
    fut = engine.submit_chain(steps, on_segment=lambda seg: first.set())
    assert first.wait(120)
    engine.abort(fut.rid)
    out = fut.result(timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert [s["index"] for s in out["segments"]] == [0]
    assert engine.load()["request_owned_slots"] == 0  # (the engine checks slot accounting after every step)


class RecordedInbox:
    """Test double around the engine's inbox: records the kind and size of each item put in it."""

    def __init__(self, inbox):
        self.inbox, self.items = inbox, []

    def put(self, item):
        kind, payload = item
        self.items.append((kind, len(payload) if kind == "reqs" else payload))
        self.inbox.put(item)

    def __getattr__(self, name):
        return getattr(self.inbox, name)


def test_requests_a_loop_submits_together_reach_the_scheduler_together(engine, monkeypatch):
    """What the coroutines of one event-loop iteration submit (a fork's prefix and its branches' chains) is
    admitted together, as one inbox item: the scheduler never starts a forward with the first alone. An abort
    after them stays after them."""
    inbox = RecordedInbox(engine._inbox)
    monkeypatch.setattr(engine, "_inbox", inbox)
    g = {"max_new_tokens": 2, "temperature": 0}
    steps = [{"text": "List: apples,", "gen": g}]

    async def chain():
        async for item in engine.async_chain(steps):
            pass
        return item

    async def together():
        return await asyncio.gather(engine.async_generate("List:", {"max_new_tokens": 0}), chain(), chain(),
                                    engine.async_generate("List: pears,", g))

    prefix, a, b, pears = asyncio.run(together())
    assert inbox.items == [("reqs", 4)]
    assert a["segments"][0]["text"] == b["segments"][0]["text"] == engine.generate("List: apples,", g)["text"]
    assert pears["text"] == engine.generate("List: pears,", g)["text"]

    async def cancelled():
        task = asyncio.ensure_future(engine.async_generate("Count:", {"max_new_tokens": 64, "ignore_eos": True}))
        await asyncio.sleep(0)  # the request is held until this iteration ends; the abort follows it
        task.cancel()
        return await asyncio.gather(task, return_exceptions=True)

    inbox.items.clear()
    assert isinstance(asyncio.run(cancelled())[0], asyncio.CancelledError)
    assert [kind for kind, _ in inbox.items] == ["reqs", "abort"]


def test_a_select_scored_by_ids_shares_its_prompt_at_once(engine, monkeypatch):
    """A chain whose select is scored in its prompt's forward goes on holding its KV; its prompt enters the tree
    then, as any prefilled request's does: a request queued behind it that shares the prompt (another instance, a
    fork's other branch) waits for it one forward (in-batch dedup), not until the chain's next call is prefilled
    too."""
    text = "Question: is a ripe banana yellow or purple, most of the time?\nOn a scale of 1 to 3, I rate it "
    steps = [{"text": text, "choices": ["1", "2", "3"], "method": token_length_normalized},
             {"text": " because it is", "gen": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}]
    ended = {}  # request id -> the forwards run when its call ended
    sched = engine.scheduler
    monkeypatch.setattr(sched, "on_call_end", lambda r, reason: ended.setdefault(r.rid, sched.stats["forwards"]))

    async def chain():
        async for item in engine.async_chain(steps):
            pass
        return item

    async def together():
        return await asyncio.gather(chain(), engine.async_generate(text + "2, since", {"max_new_tokens": 1}))

    assert engine.flush_cache()
    before = sched.stats["forwards"]
    _, behind = asyncio.run(together())
    assert ended[int(behind["meta_info"]["id"])] - before == 2  # the chain's first forward, then its own
    assert behind["meta_info"]["cached_tokens"] >= len(engine.tokenizer.encode(text)) - 2


@pytest.mark.parametrize("program", [gen_then_fork, nested])
def test_forks_after_a_call_are_child_requests_with_the_same_outputs_under_every_policy(local, engine, program):
    be, counted = local
    sched = engine.scheduler
    before_policy, outs = sched.cfg.policy, {}
    try:
        for policy in ("program", "lpm", "dfs-weight", "fcfs"):
            sched.cfg.policy = policy
            for on in (True, False):
                counted.count, forked = 0, engine.stats()["forked_branches"]
                st = _run(program, be, engine, on, topic="the moon")
                outs[policy, on] = (st.variables(), st.text())
                if on:  # the branches after a call were the engine's own requests: none reached its inbox
                    assert engine.stats()["forked_branches"] - forked == (2 if program is gen_then_fork else 4)
                    # the parent's chain and the gen after the join; the two plans' chains (and, where the policy
                    # shares no prefix in a batch, the outer fork's prefill hint: Fork.prefill)
                    assert counted.count == (2 if program is gen_then_fork else 2 + (policy == "fcfs"))
    finally:
        sched.cfg.policy = before_policy
    assert all(v == outs["program", False] for v in outs.values()), outs


G2 = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}


def _fork_steps(long: int = 2):
    return [{"text": "Topic: the sea\nFact:", "gen": G2},
            {"text": "", "branches": [[{"text": f"\n{word}:", "gen": G2},  # (no shared text: no in-batch dedup)
                                       {"text": "\nMore:", "gen": {**G2, "max_new_tokens": long}}]
                                      for word in ("Red", "Blue")]}]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_forks_branches_start_in_the_next_forward_while_others_run(engine, monkeypatch, overlap):
    """The parent's last call ends in forward F: its branches are queued in that step and prefill in F + 1 (mixed
    with the other request's decode), not a forward later as branches submitted from the frontend would be. (With
    no chain window: where decode steps replay CUDA graphs, the engine's default holds them for company.)"""
    sched = engine.scheduler
    monkeypatch.setattr(sched.cfg, "chain_batch_steps", 0)
    monkeypatch.setattr(sched, "overlap", overlap)  # the CPU's default is off, a GPU's on
    ended = {}  # request id -> forwards run when each of its calls ended
    monkeypatch.setattr(sched, "on_call_end", lambda r, reason: ended.setdefault(r.rid, []).append(
        sched.stats["forwards"]))
    busy = engine.submit("Count slowly:", {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
    out = engine.submit_chain(_fork_steps()).result(timeout=120)
    busy.result(timeout=120)
    parent = int(out["meta_info"]["id"])
    children = [rid for rid in ended if rid not in (parent, int(busy.rid))]
    assert len(children) == 2 and [s["index"] for s in out["segments"]] == [0]
    # 2 tokens, 2 tokens: its first forward right after the parent's end. Under overlap the forward after F was
    # launched before F's output was processed, so each call's end is seen a forward later
    lag = 1 if overlap else 0
    for rid in children:
        assert ended[rid][0] - ended[parent][0] == 2 + lag and ended[rid][1] - ended[rid][0] == 2 + lag
    alone = engine.generate("Topic: the sea\nFact:", G2)["text"]
    assert out["segments"][0]["text"] == alone


def test_branch_segments_stream_tagged_then_their_end(engine):
    async def consume():
        return [item async for item in engine.async_chain(_fork_steps())]

    items = asyncio.run(consume())
    assert "index" in items[0] and "branch" not in items[0]
    for b in (0, 1):
        mine = [it for it in items if it.get("branch") == b]
        assert [it.get("index", "end") for it in mine] == [0, 1, "end"] and mine[-1]["stopped_at"] is None
    assert "segments" in items[-1] and "branch" not in items[-1]  # the parent's result, after every branch's end


def test_aborted_fork_frees_its_branches(engine):
    seen = threading.Event()
    fut = engine.submit_chain(_fork_steps(long=400), on_segment=lambda seg: "branch" in seg and seg.get("index") == 0
                              and seen.set())
    assert seen.wait(120)
    engine.abort(fut.rid)
    out = fut.result(timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    load = engine.load()
    assert load["request_owned_slots"] == 0 and load["resident_requests"] == 0 and not engine.scheduler.forking


def test_a_failing_branch_fails_its_instance_alone(engine, tokenizer, monkeypatch):
    other = [{"text": "Topic: the hills\nFact:", "gen": {**G2, "max_new_tokens": 6}}]
    alone = engine.submit_chain(other).result(timeout=120)["segments"][0]["text"]
    fault = FaultyForward(engine.runner.launch, lambda r, sb: r.fork_parent is not None and r.chain.branch == 1)
    monkeypatch.setattr(engine.runner, "launch", fault)
    futs = [engine.submit_chain(_fork_steps(long=6)), engine.submit_chain(other)]
    with pytest.raises(EngineError, match="injected fault"):
        futs[0].result(timeout=120)
    assert futs[1].result(timeout=120)["segments"][0]["text"] == alone
    monkeypatch.undo()
    assert fault.raised >= 1 and engine.load()["request_owned_slots"] == 0 and not engine.scheduler.forking


def test_chains_wait_for_company_where_decode_steps_replay_graphs(local, engine, monkeypatch):
    """SchedulerConfig.chain_batch_steps (on where decode steps replay CUDA graphs, here forced on the CPU): the
    chains of a batch's instances extend together, in fewer prefill forwards, with the same outputs. Overlap off (the
    CPU's default; the session engine on a GPU overlaps): under overlap this batch of six instances in near lockstep
    takes 9 prefill forwards with the window against 7 without (the two chains that finish their first gen a step
    early wait instead of extending inside the others' decode steps), a known cost of the window; the examples, whose
    instances drift apart, take fewer (benchmarks/gpu_forward_probe.py)."""
    be, _ = local
    monkeypatch.setattr(engine.scheduler, "overlap", False)
    topics = [{"topic": t} for t in ("the moon", "bread", "rivers", "owls", "glass", "tea")]
    prog = mixed.compile()

    def run(window):
        monkeypatch.setattr(engine.scheduler.cfg, "chain_batch_steps", window)
        engine.flush_cache()
        before = engine.stats()
        states = prog.run_batch(topics, backend=be, temperature=0)
        assert all(st.error() is None for st in states)
        return [st.variables() for st in states], engine.stats()["prefill_forwards"] - before["prefill_forwards"]

    at_once, at_once_prefills = run(0)
    batched, batched_prefills = run(8)
    assert batched == at_once
    assert batched_prefills < at_once_prefills
