"""Requests sharing the prompt of a prefill still in flight borrow its slots (scheduler/prefill.py, cache.py's
shared blocks): with overlap, a batch of programs on one long prefix is admitted while the first one's prefill
runs, so no decode step runs for that first request alone, and every output equals the engine's without overlap.
A borrower whose lender's forward fails before it filled the slots goes back to the queue and computes them."""
from concurrent.futures import Future

from lmc.runtime.runner import Launch

HEADER = ("The history of the city begins with a small fishing village on the river. Over the centuries merchants "
          "built warehouses, bridges and a cathedral, and the town grew into a center of trade and learning. ")
PROGRAMS = [HEADER + f"Question {i}: what did the merchants of the town build in year {1000 + 37 * i}?"
            for i in range(6)]
PARAMS = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_programs_on_one_prefix_borrow_the_first_ones_prefill(plain, overlapped):
    want = [o["output_ids"] for o in plain.generate(PROGRAMS, PARAMS)]
    overlapped.flush_cache()
    before = overlapped.stats()
    out = overlapped.generate(PROGRAMS, PARAMS)
    after = overlapped.stats()
    assert [o["output_ids"] for o in out] == want
    # the first program's prefill, then the other five's (borrowing it) while it runs; then 4 decode steps for
    # all six: no decode step of the first program alone while the others wait for its prefix
    assert after["prefill_forwards"] - before["prefill_forwards"] == 2
    assert after["decode_forwards"] - before["decode_forwards"] == PARAMS["max_new_tokens"] - 1
    n_header = len(overlapped.tokenizer.encode(HEADER)) - 1
    assert all(o["meta_info"]["cached_tokens"] >= n_header for o in out[1:])  # borrowed, not computed
    s = overlapped.stats()
    assert s["free_slots"] + s["cached_slots"] == s["total_slots"]


class LostForward:
    """Test double around ModelRunner.launch: the prefill of a poisoned request never runs on the device and its
    error surfaces at collect(), after the next step was launched (so its KV slots are never written)."""

    def __init__(self, launch, poisoned):
        self.launch, self.poisoned, self.raised = launch, poisoned, 0

    def __call__(self, sb):
        if sb.is_decode or not any(self.poisoned(r) for r in sb.reqs):
            return self.launch(sb)
        self.raised += 1
        failed: Future = Future()
        failed.set_exception(RuntimeError("injected lost forward"))
        return Launch(sb, [i for i, s in enumerate(sb.sample) if s], [], failed)


def test_borrowers_of_a_failed_lender_compute_the_prefix_themselves(plain, overlapped, monkeypatch):
    want = [o["output_ids"] for o in plain.generate(PROGRAMS, PARAMS)]
    overlapped.flush_cache()
    lender = overlapped.tokenizer.encode(PROGRAMS[0])
    fault = LostForward(overlapped.runner.launch, lambda r: r.input_ids == lender)
    monkeypatch.setattr(overlapped.runner, "launch", fault)
    out = overlapped.generate(PROGRAMS, PARAMS)
    monkeypatch.undo()
    assert fault.raised >= 1 and "injected lost forward" in out[0]["error"]
    assert [o["output_ids"] for o in out[1:]] == want[1:]
    s = overlapped.stats()
    assert s["free_slots"] + s["cached_slots"] == s["total_slots"]
