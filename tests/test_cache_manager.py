"""The scheduler's CacheManager (lmc/runtime/scheduler/cache.py) on its own, no model: random sequences of what the
scheduler does to request memory (admit on a matched prefix, allocate positions, complete forwards, share a
running request's prefix, truncate as a jump does, release, evict) keep the slot accounting invariant after
every operation, including with forwards still "in flight" (positions allocated but not completed)."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc.runtime.core import Req, SamplingParams
from lmc.runtime.scheduler.cache import CacheManager

VOCAB = 4  # few distinct tokens: prompts share prefixes often


def _admit(mem: CacheManager, r: Req) -> bool:
    r.prefix_slots, r.match_node = mem.match(r.fill_ids[:len(r.fill_ids) - 1])
    mem.tree.lock(r.match_node)
    if mem.room < len(r.fill_ids) - len(r.prefix_slots) + 2 or not mem.admit(r):
        mem.tree.unlock(r.match_node)
        return False
    return True


def _alloc(mem: CacheManager, r: Req, n: int, device: torch.Tensor | None = None) -> None:
    """n more positions for r, growing its sequence like decoding does (a sampled token per new position).
    device: the runner's slot table, which the batch of these positions then updates (_send_batch)."""
    while r.kv_len + n > r.seq_len:
        r.output_ids.append(random.randrange(VOCAB))
    lo = r.kv_len
    slots = mem.extend(r, n)
    if device is not None:
        _send_batch(mem, device, [(r.row, lo + i, int(s)) for i, s in enumerate(slots)])


def _send_batch(mem: CacheManager, device: torch.Tensor, new_tokens: list) -> None:
    """What a batch does to the runner's device table: the pending writes, then its new tokens' slots (runner.py's
    order). A position written twice by the pending writes must get one value: CUDA's index_put keeps either."""
    written = {}
    for row, start, slots in mem.take_pending():
        for col, v in enumerate(slots.tolist(), start):
            assert written.setdefault((row, col), v) == v, f"row {row} position {col} written twice, differently"
            device[row, col] = v
    for row, col, v in new_tokens:
        device[row, col] = v


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), disabled=st.booleans())
def test_random_request_lifecycles_keep_the_slot_accounting(seed, disabled):
    random.seed(seed)
    mem = CacheManager(num_rows=6, context_length=64, num_slots=96, disabled=disabled)
    device = mem.table.clone()  # the runner's copy of the slot table
    resident: list[Req] = []
    for _ in range(120):
        op = random.choice(["admit", "admit", "extend", "complete", "share", "truncate", "release", "evict",
                            "batch"])
        if op == "admit":
            r = Req([random.randrange(VOCAB) for _ in range(random.randint(2, 12))], SamplingParams())
            if _admit(mem, r):
                _alloc(mem, r, len(r.fill_ids) - r.kv_len, device)
                resident.append(r)
        elif op == "batch":  # (a decode step's new tokens aside) the device table agrees with the host's
            _send_batch(mem, device, [])
            for q in resident:
                assert torch.equal(device[q.row, :q.kv_len], mem.table[q.row, :q.kv_len]), "device table drifted"
        elif resident:
            r = random.choice(resident)
            room = mem.room
            if op == "extend" and room >= 3 and r.kv_len + 3 < 64:
                _alloc(mem, r, random.randint(1, 3), device)
            elif op == "complete":  # a forward over r's allocated positions was collected
                r.kv_done = r.kv_len
            elif op == "share" and not disabled:
                mem.cache_unfinished(r)
            elif op == "truncate":  # a jump rolls r back to an earlier position, then r leaves the batch
                mem.truncate(r, random.randint(0, r.kv_len))
                mem.release(r)
                resident.remove(r)
            elif op == "release":  # finished, aborted or retracted, possibly with positions still in flight
                mem.release(r)
                resident.remove(r)
            elif op == "evict":
                mem.evict(random.randint(1, 20))
        mem.check(resident)
    for r in list(resident):
        r.kv_done = r.kv_len
        mem.release(r)
    mem.check([])
    assert mem.slots.available + mem.tree.total_size == mem.slots.num_slots
    assert mem.rows.available == mem.rows.num_rows - 1  # every row but the dummy row 0 is free again


def test_only_completed_kv_enters_the_tree():
    mem = CacheManager(num_rows=3, context_length=16, num_slots=32)
    r = Req([1, 2, 3, 0, 1], SamplingParams())
    assert _admit(mem, r)
    mem.extend(r, 5)
    r.kv_done = 3  # a forward over positions 3..4 is still in flight when r is released
    mem.release(r)
    mem.check([])
    assert mem.tree.total_size == 3 and mem.slots.available == 29
    assert len(mem.tree.peek([1, 2, 3, 0, 1])) == 3 and r.epoch == 1


def test_adopted_prefix_slots_go_to_the_device_with_the_next_batch():
    """A second request computing a prefix the first one cached meanwhile adopts the tree's slots: the host table
    changes at once, the device table through `pending` (taken by the next batch)."""
    mem = CacheManager(num_rows=4, context_length=16, num_slots=32)
    a, b = Req([3, 1, 2, 2], SamplingParams()), Req([3, 1, 2, 0], SamplingParams())
    for r in (a, b):
        assert _admit(mem, r)
        mem.extend(r, 4)
        r.kv_done = 4
    assert mem.take_pending() == []  # nothing was cached when they were admitted
    mem.cache_unfinished(a)
    mem.cache_unfinished(b)
    (row, start, slots), = mem.take_pending()
    assert (row, start) == (b.row, 0) and torch.equal(slots, mem.table[a.row, :3].long())
    assert torch.equal(mem.table[b.row, :3], mem.table[a.row, :3])
    mem.check([a, b])


def test_the_dummy_row_is_never_handed_out():
    mem = CacheManager(num_rows=3, context_length=8, num_slots=8)
    rows = [mem.rows.alloc(), mem.rows.alloc(), mem.rows.alloc()]
    assert rows == [1, 2, None]


@pytest.mark.parametrize("name", ["lpm", "dfs-weight", "fcfs", "random"])
def test_policies_are_registered(name):
    from lmc.runtime.scheduler.policy import POLICIES, get_policy

    assert get_policy(name) is POLICIES[name]
    with pytest.raises(ValueError, match="unknown schedule policy"):
        get_policy("shortest-job-first")


def test_a_rows_pending_writes_reach_the_device_once_with_its_latest_slots():
    """A request released with a device-table write pending (it adopted cached slots, then was aborted before the
    next batch), and the next owner of its row admitted on another cached prefix before that batch: the batch
    writes each position of the row once, with the new owner's slots. (On the GPU both writes went in one
    index_put, which keeps either value for a duplicate index: the next request attended to its predecessor's
    KV and generated garbage, found by tests/engine_drift.py.)"""
    mem = CacheManager(num_rows=3, context_length=16, num_slots=32)
    device = mem.table.clone()
    d = Req([1, 1, 1, 1, 0], SamplingParams())  # a finished request: its prompt is the tree's
    assert _admit(mem, d)
    _alloc(mem, d, 5, device)
    d.kv_done = 5
    mem.release(d)
    a, b = Req([3, 1, 2, 2], SamplingParams()), Req([3, 1, 2, 0], SamplingParams())
    for r in (a, b):
        assert _admit(mem, r)
        _alloc(mem, r, 4, device)
        r.kv_done = 4
    mem.cache_unfinished(a)
    mem.cache_unfinished(b)  # b adopts a's slots for [3, 1, 2]: a write pending for b's row
    row = b.row
    mem.release(b)
    c = Req([1, 1, 1, 1, 2], SamplingParams())
    assert _admit(mem, c) and c.row == row  # the only free row, on d's cached [1, 1, 1, 1]
    _alloc(mem, c, 1, device)
    assert torch.equal(device[row, :5], mem.table[row, :5])
    assert torch.equal(device[row, :4], mem.tree.peek([1, 1, 1, 1]).to(torch.int32))
    mem.check([a, c])
