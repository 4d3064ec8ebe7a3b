"""The program-aware scheduling policy and KV retention by next use (issue 14), on synthetic queues and a bare
CacheManager (no model): ordering rules, the aging bound, eviction order, and the slot accounting with retention on.
The same variables under every policy on real programs: tests/test_program_policy_outputs.py."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmc
from lmc.protocol.hints import ProgramHints
from lmc.runtime.core import Req, SamplingParams
from lmc.runtime.radix_cache import RadixCache
from lmc.runtime.scheduler.cache import CacheManager
from lmc.runtime.scheduler.policy import POLICIES, PolicyContext, ProgramAware
from lmc.runtime.scheduler.programs import ProgramLedger


class FakeClock:
    """A test double for time.monotonic: advanced by hand."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _ctx(clock=None) -> PolicyContext:
    return PolicyContext(RadixCache(), random.Random(0), ProgramLedger(clock=clock or FakeClock()))


def _req(matched: int = 0, hints: ProgramHints | None = None, max_new: int = 16) -> Req:
    r = Req([1] * (matched + 4), SamplingParams(max_new_tokens=max_new), program=hints)
    r.prefix_slots = torch.arange(matched)
    return r


@settings(max_examples=40, deadline=None)
@given(matches=st.lists(st.integers(0, 40), max_size=12))
def test_without_hints_program_orders_as_lpm(matches):
    ctx = _ctx()
    q = [_req(m) for m in matches]
    assert POLICIES["program"].order(q, ctx) == POLICIES["lpm"].order(q, ctx)


def test_shortest_remaining_work_first_by_the_plans_bound():
    ctx = _ctx()
    long, mid, short = (_req(30, ProgramHints(name, tokens_left=t)) for name, t in (("a", 500), ("b", 50), ("c", 5)))
    assert POLICIES["program"].order([long, mid, short], ctx) == [short, mid, long]


def test_unbounded_work_falls_back_to_least_attained_service():
    """tokens_left None: the instance that has generated fewer tokens goes first (PLAS), whatever its prefix."""
    ctx = _ctx()
    ran_long, ran_short = (ProgramHints(name, calls_left=3, tokens_left=None) for name in ("long", "short"))
    for hints, generated in ((ran_long, 200), (ran_short, 10)):
        done = _req(0, hints)
        done.output_ids = [2] * generated
        done.finished = True
        ctx.programs.released(done)
    a, b = _req(40, ran_long), _req(0, ran_short)
    assert POLICIES["program"].order([a, b], ctx) == [b, a]
    assert ctx.programs.instances["long"].attained == 200


def test_a_plain_request_is_a_one_call_program_bounded_by_its_max_new_tokens():
    ctx = _ctx()
    plain = _req(0, None, max_new=8)
    bounded = _req(0, ProgramHints("x", tokens_left=100))
    assert POLICIES["program"].order([bounded, plain], ctx) == [plain, bounded]


def test_work_of_the_same_doubling_level_is_a_tie_the_prefix_match_decides():
    ctx = _ctx()
    # work: 4 uncached prompt tokens + tokens_left; a and b at level 16-31, c at the next (32-63)
    a, b = _req(0, ProgramHints("a", tokens_left=13)), _req(30, ProgramHints("b", tokens_left=26))
    c = _req(60, ProgramHints("c", tokens_left=28))
    assert POLICIES["program"].order([a, c, b], ctx) == [b, a, c]


def test_ties_go_to_the_longer_prefix_match_then_first_seen():
    ctx = _ctx()
    h = [ProgramHints(str(i), tokens_left=20) for i in range(3)]
    first, longer, shorter = _req(5, h[0]), _req(30, h[1]), _req(5, h[2])
    assert POLICIES["program"].order([first, shorter, longer], ctx) == [longer, first, shorter]


def test_an_instances_work_level_halves_with_every_halving_time_since_it_arrived():
    """Work 204 (level 8) arrived at 0 against work 24 (level 5) arriving later: the short one goes first when it
    arrives 1 s later; one arriving 8 s later finds the long instance's level at 8 - 4 = 4 and waits behind it."""
    clock = FakeClock()
    ctx, policy = _ctx(clock), ProgramAware(max_wait_s=100, halving_s=2.0)
    old = _req(0, ProgramHints("old", tokens_left=200))
    policy.order([old], ctx)
    clock.t = 1.0
    early = _req(0, ProgramHints("early", tokens_left=20))
    assert policy.order([old, early], ctx) == [early, old]
    clock.t = 8.0
    late = _req(0, ProgramHints("late", tokens_left=20))
    assert policy.order([late, old], ctx) == [old, late]
    assert ctx.programs.age(old, clock.t) == 8.0 and ctx.programs.age(late, clock.t) == 0.0


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(arrivals=st.lists(st.integers(0, 3), min_size=30, max_size=60), wait=st.integers(1, 8),
       before=st.integers(0, 4))
def test_aging_bounds_the_wait_of_a_long_program_under_a_flood_of_short_ones(arrivals, wait, before):
    """One admission per tick; short programs keep arriving. The long program's request is admitted within
    max_wait_s + (requests seen before it) + 1 ticks of arriving (the bound in ProgramAware's docstring)."""
    clock = FakeClock()
    ctx, policy = _ctx(clock), ProgramAware(max_wait_s=wait)
    waiting = [_req(0, ProgramHints(f"early{i}", tokens_left=1000 + i)) for i in range(before)]
    policy.order(waiting, ctx)  # seen at tick 0
    clock.t = 1.0
    long = _req(0, ProgramHints("long", tokens_left=10**6))
    waiting.append(long)
    seen_before = len(waiting) - 1
    for tick, n in enumerate(arrivals, start=1):
        clock.t = float(tick)
        waiting += [_req(0, ProgramHints(f"s{tick}.{j}", tokens_left=3)) for j in range(n)]
        admitted = policy.order(waiting, ctx)[0]
        waiting.remove(admitted)
        if admitted is long:
            assert tick - 1 <= wait + seen_before + 1
            return
    assert len(arrivals) < wait + seen_before + 2, "the long program was never admitted"


# ---- retention -----------------------------------------------------------------------------------------------
def _finish(mem: CacheManager, tokens: list[int], hints: ProgramHints | None) -> Req:
    """Run one request through the memory like the scheduler does (admit, compute everything, finish)."""
    r = Req(tokens, SamplingParams(), program=hints)
    r.prefix_slots, r.match_node = mem.match(r.fill_ids[:-1])
    mem.tree.lock(r.match_node)
    assert mem.admit(r)
    mem.extend(r, len(tokens) - r.kv_len)
    r.kv_done = r.kv_len
    r.finished = True
    mem.release(r)
    mem.check([])
    return r


def _evicted_order(mem: CacheManager, firsts: list[int]) -> list[int]:
    """Evict one leaf at a time; return the first tokens of the sequences in the order they went."""
    out = []
    while mem.tree.evictable_size:
        before = {t for t in firsts if len(mem.tree.peek([t, t + 1, t + 2]))}
        mem.evict(1)
        out += sorted(before - {t for t in firsts if len(mem.tree.peek([t, t + 1, t + 2]))})
    return out


@pytest.mark.parametrize("retaining", [True, False])
def test_eviction_order_follows_the_plan(retaining):
    """Finished instances first, then untagged (LRU), then known next uses, the furthest first; LRU alone when
    the program policy is not scheduling."""
    mem = CacheManager(num_rows=8, context_length=64, num_slots=128)
    mem.programs.retaining = retaining
    near = _finish(mem, [10, 11, 12, 13], ProgramHints("near", calls_left=3, next_use=1))
    far = _finish(mem, [20, 21, 22, 23], ProgramHints("far", calls_left=5, next_use=4))
    plain = _finish(mem, [30, 31, 32, 33], None)
    done = _finish(mem, [40, 41, 42, 43], ProgramHints("done", calls_left=1, next_use=None))
    assert all(r.finished for r in (near, far, plain, done))
    order = _evicted_order(mem, [10, 20, 30, 40])
    assert order == ([40, 30, 20, 10] if retaining else [10, 20, 30, 40])


def test_a_passed_next_use_and_an_idle_instance_lose_their_protection():
    clock = FakeClock()
    mem = CacheManager(num_rows=8, context_length=64, num_slots=128)
    mem.programs = ProgramLedger(clock=clock, retain_s=30.0)
    mem.programs.retaining = True
    _finish(mem, [10, 11, 12, 13], ProgramHints("a", calls_left=3, next_use=1))
    _finish(mem, [20, 21, 22, 23], ProgramHints("b", calls_left=3, next_use=1))
    _finish(mem, [30, 31, 32, 33], None)  # most recently used: LRU alone would evict it last
    _finish(mem, [50, 51, 52, 53], ProgramHints("a", calls_left=2, next_use=1))  # a's next use came and went
    clock.t = 31.0  # ... and b went idle
    mem.programs.state("a")  # a is active again
    order = _evicted_order(mem, [10, 20, 30, 50])
    assert order[:3] == [10, 20, 30] and order[3] == 50


@lmc.function
def fork_then_merge(s, topic):
    """Branches on a shared text, then host code that reads them (a graph break) and a merge after it."""
    s += "Topic: " + topic + "\n"
    forks = s.fork(2)
    for k, f in enumerate(forks):
        f += f"Idea {k}:" + lmc.gen("idea", max_tokens=6, stop="\n")
    forks.join()
    for f in forks:
        s += "- " + f["idea"] + "\n"
    s += "Best:" + lmc.gen("best", max_tokens=4)


def test_fork_branches_keep_the_prefix_the_join_goes_on_with():
    """A fork's branches end their segment's calls, but the parent goes on after the join with the text they start
    with (the load benchmark's judges: four branches on an article, then a merge that extends it). With the plan's
    hints the instance is not finished when its branches are, and their shared prefix outlasts untagged KV used
    after it (without them the branches' leaves went first, then the prefix, as least recently used)."""
    from lmc.compiler.hints import segment_hints

    g = fork_then_merge.compile().graph()
    assert g.node(g.order()[-1]).kind == "break"
    branch = list(segment_hints(g).values())
    assert len(branch) == 2 and all(h.calls_left == 1 and h.next_use == 2 for h in branch)
    mem = CacheManager(num_rows=8, context_length=64, num_slots=128)
    mem.programs.retaining = True
    for first, h in zip((70, 80), branch):
        _finish(mem, [60, 61, 62, 63, first, first + 1], ProgramHints("judge", h.calls_left, h.tokens_left,
                                                                         h.next_use))
    plain = _finish(mem, [30, 31, 32, 33], None)
    assert plain.finished and not mem.programs.instances["judge"].finished
    assert _evicted_order(mem, [30, 60]) == [30, 60]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6))
def test_retention_keeps_the_slot_accounting(seed):
    """Random hinted request lifecycles on a small pool with retention on: every slot stays accounted for."""
    rng = random.Random(seed)
    mem = CacheManager(num_rows=6, context_length=64, num_slots=48)
    mem.programs.retaining = True
    for _ in range(40):
        tokens = [rng.randrange(3) for _ in range(rng.randint(2, 10))]
        hints = rng.choice([None, ProgramHints(str(rng.randrange(4)), calls_left=rng.randint(1, 3),
                                                next_use=rng.choice([None, 1, 2, 5]))])
        r = Req(tokens, SamplingParams(), program=hints)
        r.prefix_slots, r.match_node = mem.match(r.fill_ids[:-1])
        mem.tree.lock(r.match_node)
        if mem.room < len(tokens) or not mem.admit(r):
            mem.tree.unlock(r.match_node)
            continue
        mem.extend(r, len(tokens) - r.kv_len)
        r.kv_done = rng.randint(r.cache_protected_len, r.kv_len)
        r.finished = rng.random() < 0.8
        mem.release(r)
        mem.check([])
