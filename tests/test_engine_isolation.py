"""One bad request never hurts another (issue 10): hostile request fields are refused with a RequestError naming
the field before they reach the scheduler thread; a step that still raises fails only the requests it can be
blamed on, the others finish with their normal output and the prefix cache survives. Also the regressions fixed
with it: prompt logprobs of a resumed prefill, cached_tokens under jump-forward, memory released by shutdown(),
linear stream detokenization."""
import gc
import json
import logging
import math
import re
import weakref

import pytest

from constrained_corpus import chat
from doubles import FaultyForward
from lmc.runtime import Engine, EngineError, RequestError
from lmc.runtime.core import Req, SamplingParams
from lmc.runtime.engine import _Deltas

GREEDY = {"max_new_tokens": 6, "temperature": 0}
WARM = ("The museum's guide to the northern galleries: tapestries, maps of the coast, and the astronomer's clocks. "
        "Visitors usually begin in the great hall. ")


# ---- hostile fields ----------------------------------------------------------------------------------------------
HOSTILE = [
    ("stop_token_ids", [10**9]),  # with min_new_tokens it used to raise IndexError inside the step
    ("stop_token_ids", 5),
    ("stop_token_ids", [True]),
    ("stop_token_ids", list(range(5000))),
    ("token_ids_logprob", [10**9]),
    ("token_ids_logprob", ["1"]),
    ("logit_bias", {str(10**9): 1.0}),
    ("logit_bias", {"9" * 40: 1.0}),
    ("logit_bias", {"5": math.nan}),
    ("logit_bias", {str(i): 1.0 for i in range(5000)}),
    ("top_logprobs_num", 10**6),  # above the vocabulary
    ("top_logprobs_num", 21),  # above the engine's limit (20)
    ("seed", 2**70),  # used to be "Overflow when unpacking long long"
    ("seed", -1),
    ("seed", True),
    ("temperature", math.nan),
    ("top_p", math.inf),
    ("frequency_penalty", -math.inf),
    ("min_p", "0.1"),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", 10**30),
    ("top_k", 2**70),
    ("ignore_eos", "yes"),
    ("return_logprob", 1),
    ("stop", ["x"] * 1000),
    ("stop", "x" * 10_000),
    ("stop", 5),
    ("stop", [None]),
]


@pytest.mark.parametrize("field,value", HOSTILE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(HOSTILE)])
def test_hostile_field_is_refused_naming_it(engine, field, value):
    params = {**GREEDY, "min_new_tokens": 2, field: value}
    with pytest.raises(RequestError, match=field):
        engine.generate("Hello", params)
    with pytest.raises(RequestError, match=field):  # streaming checks the same, before anything is queued
        next(iter(engine.stream("Hello", params)))


@pytest.mark.parametrize("input_ids,match", [(["a", "b"], "input_ids must be integers"),
                                             ([1.5, 2], "input_ids must be integers"),
                                             ([True, 5], "input_ids must be integers"),
                                             ([5, 10**9], "input_ids must be in"),
                                             ([-1], "input_ids must be in"),
                                             (7, "input_ids must be a list"),
                                             ("hello", "input_ids must be a list"),
                                             ([], "empty")])
def test_hostile_input_ids_are_refused(engine, input_ids, match):
    with pytest.raises(RequestError, match=match):
        engine.generate(input_ids=input_ids, sampling_params=GREEDY)


def test_wrong_types_for_prompt_and_params(engine):
    with pytest.raises(RequestError, match="prompt must be a string"):
        engine.generate(prompt=123, sampling_params=GREEDY)
    bad, ok = engine.generate(prompt=[{"text": "x"}, "Hello"], sampling_params=GREEDY)
    assert "prompt must be a string" in bad["error"] and len(ok["output_ids"]) == 6
    with pytest.raises(RequestError, match="sampling_params"):
        engine.generate("Hello", "temperature=0")
    with pytest.raises(RequestError, match="top_logprobs_num"):
        engine.generate("Hello", GREEDY, return_logprob=True, top_logprobs_num=10**6)


def test_the_limits_that_are_allowed_still_work(engine):
    top = engine.max_top_logprobs
    r = engine.generate("Hello", {**GREEDY, "seed": 2**63 - 1, "temperature": 1.0, "top_k": 10**9,
                                  "stop_token_ids": [engine.vocab_size - 1]},
                        return_logprob=True, top_logprobs_num=top)
    assert len(r["output_ids"]) == 6 and all(len(t) == top for t in r["meta_info"]["output_top_logprobs"])


def test_a_hostile_request_in_a_batch_of_ordinary_ones(engine, tokenizer):
    """The request of the issue, among ordinary ones: it is refused alone, the others decode as if alone, and the
    warm prefix stays cached."""
    engine.generate(WARM + "Question 0?", GREEDY)
    prompts = [WARM + f"Question {i}?" for i in range(1, 5)]
    alone = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
    params = [GREEDY, GREEDY, {**GREEDY, "stop_token_ids": [10**9], "min_new_tokens": 2}, GREEDY]
    out = engine.generate(prompts, params)
    assert "stop_token_ids" in out[2]["error"]
    assert [out[i]["output_ids"] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
    warm = engine.generate(WARM + "Question 9?", GREEDY)
    assert warm["meta_info"]["cached_tokens"] >= len(tokenizer.encode(WARM)) - 2


# ---- a step that raises ----------------------------------------------------------------------------------------
def _marked(tokenizer, text):
    ids = tokenizer.encode(text)
    return lambda r, sb: r.input_ids == ids


def test_a_failing_prefill_fails_only_the_blamed_request(engine, tokenizer, monkeypatch, caplog):
    """Five requests in one prefill, one of which makes the forward raise: bisection singles it out."""
    engine.generate(WARM + "Warm-up?", GREEDY)
    prompts = [WARM + f"Room {i}?" for i in range(5)]
    alone = [r["output_ids"] for r in engine.generate(prompts, GREEDY)]  # the same batch without the fault
    failed_before = engine.stats()["failed_requests"]
    fault = FaultyForward(engine.runner.launch, _marked(tokenizer, prompts[3]))
    monkeypatch.setattr(engine.runner, "launch", fault)
    with caplog.at_level(logging.ERROR, logger="lmc.runtime"):
        futs, _ = engine._submit_all(prompts, GREEDY, None, {})  # one batch, as generate() submits it
        results = [f.exception() or f.result() for f in futs]
    monkeypatch.undo()
    assert isinstance(results[3], EngineError) and "injected fault" in str(results[3])
    assert [results[i]["output_ids"] for i in (0, 1, 2, 4)] == [alone[i] for i in (0, 1, 2, 4)]
    assert fault.raised >= 3, "the poisoned request shared its forwards with others, then was singled out"
    assert engine.stats()["failed_requests"] == failed_before + 1
    assert any(f"request {futs[3].rid} " in rec.getMessage() and rec.exc_info for rec in caplog.records)
    warm = engine.generate(WARM + "Room 9?", GREEDY)  # the radix cache survived
    assert warm["meta_info"]["cached_tokens"] >= len(tokenizer.encode(WARM)) - 2


def test_a_failing_decode_fails_only_the_blamed_request(engine, tokenizer, monkeypatch):
    prompts = [f"Step {i}: the list of prime numbers begins" for i in range(4)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = [r["output_ids"] for r in engine.generate(prompts, params)]
    ids = tokenizer.encode(prompts[1])
    fault = FaultyForward(engine.runner.launch,
                          lambda r, sb: r.input_ids == ids and sb.is_decode and len(r.output_ids) >= 4)
    monkeypatch.setattr(engine.runner, "launch", fault)
    out = engine.generate(prompts, params)
    monkeypatch.undo()
    assert "injected fault" in out[1]["error"] and fault.raised >= 1
    assert [out[i]["output_ids"] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    again = engine.generate(prompts[1], params)
    assert again["output_ids"] == alone[1] and again["meta_info"]["cached_tokens"] == len(ids) - 1


def test_an_error_processing_one_request_fails_it_alone(engine, tokenizer, monkeypatch):
    sched = engine.scheduler
    ids = tokenizer.encode("Process me")
    real = sched._finish_reason

    def finish_reason(r, tok):  # test double: the stop check breaks on one request
        if r.input_ids == ids:
            raise KeyError("injected fault in output processing")
        return real(r, tok)

    monkeypatch.setattr(sched, "_finish_reason", finish_reason)
    out = engine.generate(["Process me", "Process you"], GREEDY)
    monkeypatch.undo()
    assert "injected fault" in out[0]["error"]
    assert out[1]["output_ids"] == engine.generate("Process you", GREEDY)["output_ids"]


def test_an_unblamable_failure_rebuilds_memory_and_keeps_the_queue(engine, monkeypatch, caplog):
    """A failure in scheduling itself: the resident request loses its KV and fails, the queued one carries on."""
    sched = engine.scheduler
    monkeypatch.setattr(sched.cfg, "max_running", 1)  # the second request waits while the first decodes
    real, calls = sched._schedule_decode, []

    def schedule_decode():  # test double: the second decode step breaks in the scheduler's own bookkeeping
        calls.append(1)
        if len(calls) == 2:
            raise AssertionError("injected scheduler fault")
        return real()

    monkeypatch.setattr(sched, "_schedule_decode", schedule_decode)
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    recoveries = engine.stats()["recoveries"]
    with caplog.at_level(logging.ERROR, logger="lmc.runtime"):
        out = engine.generate(["Queue one", "Queue two"], params)
    monkeypatch.undo()
    assert "dropped" in out[0]["error"] and "injected scheduler fault" in out[0]["error"]
    assert out[1]["output_ids"] == engine.generate("Queue two", params)["output_ids"]
    assert engine.stats()["recoveries"] == recoveries + 1
    assert any("KV memory rebuilt" in rec.getMessage() for rec in caplog.records)


def test_a_device_fault_is_not_retried_and_drops_the_batch(engine, tokenizer, monkeypatch):
    """A CUDA error poisons everything computed since: no bisection, the KV memory is rebuilt and the requests
    that held KV fail; the engine serves the next request."""
    fault = FaultyForward(engine.runner.launch, _marked(tokenizer, "Device one"),
                          message="CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine.runner, "launch", fault)
    out = engine.generate(["Device one", "Device two"], GREEDY)
    monkeypatch.undo()
    assert fault.raised == 1 and all("illegal memory access" in r["error"] for r in out)
    assert len(engine.generate("Device two", GREEDY)["output_ids"]) == 6


# ---- regressions -----------------------------------------------------------------------------------------------
def test_a_resumed_prefill_records_prompt_logprobs_once(engine, tokenizer):
    """Retracted, with its prompt KV evicted, a request recomputes its prompt: its logprobs are not appended
    again (they were duplicated)."""
    stepped = Engine(max_total_tokens=256, max_running_requests=2, start=False)
    try:
        sched = stepped.scheduler
        ids = tokenizer.encode("One two three four five six seven eight")
        opts = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
        r = stepped.make_request(None, params, ids, **opts)
        sched.add(r)
        sched.step()
        sched.step()
        sched._retract()  # its KV goes to the tree...
        sched.cache.evict(sched.cache.total_size)  # ...and is evicted: the prompt is recomputed
        assert r.row == -1 and sched.cache.total_size == 0
        while not r.finished:
            sched.step()
            sched.check_invariants()
        got = r.result()["meta_info"]
    finally:
        stepped.shutdown()
    want = engine.generate(input_ids=ids, sampling_params=params, **opts)["meta_info"]
    assert len(got["input_token_logprobs"]) == len(ids) == len(got["input_top_logprobs"])
    assert [t for _, t, _ in got["input_token_logprobs"]] == ids
    assert [lp for lp, _, _ in got["input_token_logprobs"][1:]] == pytest.approx(
        [lp for lp, _, _ in want["input_token_logprobs"][1:]], abs=1e-4)
    assert r.output_ids == engine.generate(input_ids=ids, sampling_params=params)["output_ids"]


def test_a_jump_requeue_with_evicted_prompt_records_prompt_logprobs_once(engine, tokenizer):
    """A jump-forward re-queues its request; with the prompt's KV evicted meanwhile, the re-prefill recomputes the
    prompt: its logprobs are recorded once."""
    stepped = Engine(max_total_tokens=256, max_running_requests=2, start=False)
    try:
        sched = stepped.scheduler
        ids = tokenizer.encode(chat("Two words as JSON."))
        params = {"max_new_tokens": 30, "temperature": 0, "regex": r'\{"a": "[a-z]{1,5}", "b": "[a-z]{1,5}"\}'}
        r = stepped.make_request(None, params, ids, return_logprob=True, logprob_start_len=0)
        sched.add(r)
        evicted = False
        while not r.finished:
            sched.step()
            if not evicted and r in sched.waiting and r.computed_tokens:  # re-queued by a jump
                sched.cache.evict(sched.cache.total_size)
                evicted = True
        assert evicted and r.jumps >= 2
        got = r.result()["meta_info"]["input_token_logprobs"]
    finally:
        stepped.shutdown()
    assert [t for _, t, _ in got] == ids


def test_cached_tokens_count_prompt_tokens_only_under_jump_forward(engine):
    """The same json_schema request twice: the second one's jumps re-prefill output tokens the first one cached;
    those are no prompt cache hits (it reported cached_tokens > prompt_tokens)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    q = chat("Describe a person as JSON.")
    params = {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}
    engine.flush_cache()
    first, second = engine.generate(q, params), engine.generate(q, params)
    assert second["meta_info"]["jumps"] > 0 and second["text"] == first["text"]
    for r in (first, second):
        m = r["meta_info"]
        assert 0 <= m["cached_tokens"] <= m["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= second["meta_info"]["prompt_tokens"] - 1


def test_shutdown_releases_memory_and_a_second_engine_works(engine):
    first = Engine(max_total_tokens=256)
    p = {"max_new_tokens": 5, "temperature": 0}
    want = engine.generate("The capital of France is", p)["output_ids"]
    assert first.generate("The capital of France is", p)["output_ids"] == want
    kv, weights = weakref.ref(first.runner.kv.k[0]), weakref.ref(first.runner.model.embed_tokens.weight)
    first.shutdown()
    gc.collect()
    assert kv() is None and weights() is None, "shutdown() left the KV buffers or the weights alive"
    with pytest.raises(RuntimeError, match="shut down"):
        first.submit("Hello", p)
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate("Hello", p)
    first.shutdown()  # idempotent
    second = Engine(max_total_tokens=256)
    try:
        assert second.generate("The capital of France is", p)["output_ids"] == want
    finally:
        second.shutdown()


# ---- streaming ---------------------------------------------------------------------------------------------------
MULTIBYTE = "Grüße aus Köln: 日本語のテキスト, emoji 😀🎉 and more — ünïcödé. Ça va? Ελληνικά 한국어"


class _CountingTokenizer:
    """Test double around the real tokenizer: records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


@pytest.mark.parametrize("stops", [(), ("テキスト",), ("😀🎉", "Köln"), ("— ü",)])
def test_stream_deltas_are_incremental_and_exact(tokenizer, stops):
    """Token by token over multi-byte text (characters split across byte-level tokens): the pushed deltas add up
    to the decoded text, never show a partial character or a stop-string prefix that may still complete, and each
    step decodes a bounded number of ids (linear, not quadratic, in the output length)."""
    ids = tokenizer.encode(MULTIBYTE * 4, add_special_tokens=False)
    counting, pushed = _CountingTokenizer(tokenizer), []
    deltas = _Deltas(counting, list(stops), pushed.append)
    r = Req([1], SamplingParams())
    stopped = False
    for k in range(1, len(ids) + 1):
        r.output_ids = ids[:k]
        deltas(r)
        so_far = "".join(c["text"] for c in pushed)
        full = tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert full.startswith(so_far) and "\ufffd" not in so_far
        hits = [full.find(s) for s in stops if s in full]
        if hits and not stopped:  # where the scheduler would stop: nothing of the stop string was streamed
            assert full[:min(hits)].startswith(so_far)
            stopped = True
    assert stopped == bool(stops)
    assert max(counting.sizes) <= 2 * _Deltas.MAX_PENDING
    r.finished, r.text = True, tokenizer.decode(ids, skip_special_tokens=True)
    deltas(r)
    assert "".join(c["text"] for c in pushed) == r.text


def test_streamed_text_equals_the_final_text(engine):
    cases = [("Count: 1, 2, 3, 4,", {"max_new_tokens": 20, "temperature": 0, "stop": [" 7", "nine"]}),
             (chat("Write a greeting in Japanese and in German."), {"max_new_tokens": 30, "temperature": 0}),
             (chat("Say hi."), {"max_new_tokens": 24, "temperature": 1.0, "seed": 3,
                                "regex": "[äöü日本語😀]{4,12}", "stop": ["本語"]})]
    for prompt, params in cases:
        chunks = list(engine.stream(prompt, params))
        streamed, whole = "".join(c["text"] for c in chunks), engine.generate(prompt, params)
        assert streamed == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
        assert len(chunks) > 2  # it was streamed, not sent at the end
    assert whole["text"] and re.fullmatch("[äöü日本語😀]{0,12}", whole["text"]) and not whole["text"].isascii()
