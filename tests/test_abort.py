"""Aborting requests: the scheduler finishes a request wherever it is (queued, decoding, prefilling in chunks) with
its KV accounted for, and the engine delivers aborts through its inbox (`abort(rid)`, closing a stream, cancelling
`async_generate`). The server side (client disconnects) is in test_server.py."""
import asyncio
import time

import pytest

from lmc.runtime import Engine

TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries merchants "
        "built warehouses, bridges and a cathedral, and the town grew into a center of trade and learning. Its "
        "university was founded by the guilds, and its library holds the oldest maps of the coast.")
LONG = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}  # runs for a long while unless aborted


@pytest.fixture(scope="module")
def stepped(tokenizer):
    """An engine whose scheduler thread is stopped, so the test drives the scheduler one step at a time and sees
    each request in the state it aborts it from (overlap off: a step's output is processed in that step). 16-token
    prefill chunks, at most 3 running requests."""
    eng = Engine(max_total_tokens=256, chunked_prefill_size=16, max_running_requests=3, start=False,
                 overlap_schedule=False)
    yield eng
    eng.shutdown()


def _no_request_owned_slots(sched) -> None:
    sched.check_invariants()
    assert sched.allocator.available + sched.cache.total_size == sched.allocator.num_slots


def test_scheduler_aborts_waiting_chunked_and_running_requests(stepped, engine, tokenizer):
    sched = stepped.scheduler
    ids = tokenizer.encode(TEXT)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    a, b, chunked, queued = (stepped.make_request(None, params, ids[i:j])
                             for i, j in ((0, 5), (5, 11), (11, 50), (50, 55)))
    for r in (a, b, chunked, queued):
        sched.add(r)
    sched.step()  # one prefill: a and b whole, the first 5 tokens of `chunked`; `queued` finds no running slot
    assert set(sched.running) == {a, b} and sched.chunked is chunked and sched.waiting == [queued]
    assert 0 < chunked.kv_len < len(chunked.input_ids)

    assert sched.abort(queued.rid) is queued
    assert queued.finished and queued.finish_reason == {"type": "abort", "message": "aborted while waiting"}
    assert queued.output_ids == [] and not sched.waiting
    sched.check_invariants()

    computed = chunked.kv_len
    assert sched.abort(chunked.rid) is chunked
    assert chunked.finish_reason == {"type": "abort", "message": "aborted while in a chunked prefill"}
    assert sched.chunked is None and chunked.row == -1
    assert len(sched.cache.peek(chunked.input_ids)) == computed  # its computed prefix went to the radix tree
    sched.check_invariants()

    sched.step()
    sched.step()  # two decode steps
    assert sched.abort(a.rid) is a
    assert a.finish_reason == {"type": "abort", "message": "aborted while running"} and a not in sched.running
    assert len(a.output_ids) == 3 and a.text == tokenizer.decode(a.output_ids, skip_special_tokens=True)
    assert len(sched.cache.peek(a.fill_ids)) == len(a.fill_ids) - 1  # all but the last sampled token had KV
    sched.check_invariants()

    while sched.has_work:
        sched.step()
        sched.check_invariants()
    assert b.finish_reason == {"type": "length", "length": 6}
    assert b.output_ids == engine.generate(input_ids=ids[5:11], sampling_params=params)["output_ids"]
    assert sched.abort(b.rid) is None and sched.abort("no-such-request") is None  # finished or unknown: no-op
    _no_request_owned_slots(sched)
    assert sched.stats["aborted"] == 3


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _idle(engine) -> bool:
    s = engine.stats()
    return s["running"] == 0 and s["waiting"] == 0


def _assert_idle_without_leaks(engine) -> None:
    _wait(lambda: _idle(engine), "the engine to go idle")
    s = engine.stats()
    assert s["free_slots"] + s["cached_slots"] == s["total_slots"]


def test_engine_abort_of_a_running_request(engine, tokenizer):
    assert engine.flush_cache()
    decodes = engine.stats()["decode_forwards"]
    fut = engine.submit(TEXT, LONG)
    _wait(lambda: engine.stats()["decode_forwards"] >= decodes + 3, "decoding to start")
    engine.abort(fut.rid)
    r = fut.result(timeout=60)
    meta = r["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "aborted while running"} and meta["id"] == fut.rid
    assert 3 <= meta["completion_tokens"] < 200 and r["text"] == tokenizer.decode(r["output_ids"])
    _assert_idle_without_leaks(engine)
    again = engine.generate(TEXT, {"max_new_tokens": 1, "temperature": 0})
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1  # the prefix was kept


def test_engine_abort_right_after_submit(engine):
    """The abort follows the request through the inbox: it finds it queued, or admitted if a step came between."""
    futs = [engine.submit(f"Request {i}: {TEXT}", LONG) for i in range(4)]
    for f in futs:
        engine.abort(f.rid)
    for f in futs:
        meta = f.result(timeout=60)["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 50
    _assert_idle_without_leaks(engine)
    assert not futs[0].cancel()  # a submitted request is stopped by abort, never by cancelling its future


def test_closing_a_stream_aborts_its_request(engine):
    aborted = engine.stats()["aborted"]
    stream = engine.stream(TEXT, LONG)
    chunks = [next(stream) for _ in range(3)]
    assert all(c["text"] for c in chunks)
    stream.close()
    _wait(lambda: engine.stats()["aborted"] == aborted + 1, "the abort")
    _assert_idle_without_leaks(engine)


def test_cancelling_async_generate_aborts_its_requests(engine):
    aborted, decodes = engine.stats()["aborted"], engine.stats()["decode_forwards"]

    async def main():
        task = asyncio.ensure_future(engine.async_generate([TEXT, "Once upon a time"], LONG))
        while engine.stats()["decode_forwards"] < decodes + 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait(lambda: engine.stats()["aborted"] == aborted + 2, "the aborts")
    _assert_idle_without_leaks(engine)


def test_invariants_check_the_device_slot_table_against_the_hosts(stepped, tokenizer):
    """check_invariants compares the runner's slot table (the one attention reads) with the scheduler's copy over
    the resident requests' positions: a drifted entry, such as the stale slot a CUDA index_put kept when a row's
    previous owner and its new one both had writes pending (cache.py), fails it, naming the row."""
    sched = stepped.scheduler
    r = stepped.make_request(None, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                             tokenizer.encode(TEXT)[:12])
    sched.add(r)
    sched.step()
    sched.check_invariants()
    table = sched.runner.table
    good = int(table[r.row, 3])
    table[r.row, 3] = good + 1
    with pytest.raises(AssertionError, match=f"row {r.row} differs from the host's at positions \\[3\\]"):
        sched.check_invariants()
    table[r.row, 3] = good
    while sched.has_work:
        sched.step()
        sched.check_invariants()
    assert r.finished and len(r.output_ids) == 4
