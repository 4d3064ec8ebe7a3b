"""Forward shaping under the `program` policy (SchedulerConfig.busy_prefill_tokens): while requests decode, a prefill
forward takes at most the policy's budget of new tokens, the instance with the least work left first (a long
prompt is chunked, and its chunks yield to shorter work arriving later), and the running requests decode in the
same forward. Driven one step at a time; the outputs are those of the session engine."""
import pytest

from lmc.protocol.hints import ProgramHints
from lmc.runtime import Engine

NUMBERS = "Here is a list of numbers: " + ", ".join(str(i) for i in range(300))


@pytest.fixture(scope="module")
def stepped():
    eng = Engine(max_total_tokens=1024, start=False, busy_prefill_tokens=64, overlap_schedule=False)  # (the GPU's
    # default overlap would process each step's output in the next step)
    yield eng
    eng.shutdown()


def test_short_work_goes_first_in_budgeted_forwards_that_keep_decoding(stepped, engine, tokenizer):
    sched = stepped.scheduler
    sched.cfg.policy = "program"
    budget = sched.cfg.busy_prefill_tokens
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompts = {"running": tokenizer.encode("Count slowly:"), "long": tokenizer.encode(NUMBERS)[:2 * budget],
               "short": tokenizer.encode("The capital of France is"),
               "later": tokenizer.encode("Write a short poem about the sea.")}
    work = {"running": 40, "long": 400, "short": 12, "later": 12}
    reqs = {k: stepped.make_request(None, params, p, program=ProgramHints(k, tokens_left=work[k]))
            for k, p in prompts.items()}
    run, long, short, later = (reqs[k] for k in ("running", "long", "short", "later"))

    sched.add(run)
    sched.step()  # its prefill: it decodes from now on
    assert sched.running == [run] and len(run.output_ids) == 1
    sched.add(long)
    sched.add(short)  # queued after the long prompt, less work: it goes first
    sched.step()
    assert short in sched.running and sched.chunked is long
    assert long.kv_len == budget - len(prompts["short"])  # the budget's rest, not the whole prompt
    assert len(run.output_ids) == 2  # it decoded in the prefill forward
    sched.add(later)  # arrives while the long prompt is chunked: its chunk waits behind less work
    sched.step()
    assert later in sched.running
    assert long.kv_len == 2 * budget - len(prompts["short"]) - len(prompts["later"])
    assert len(run.output_ids) == 3 and len(short.output_ids) == 2
    while not all(r.finished for r in reqs.values()):
        sched.step()
        sched.check_invariants()
    assert short.forward_passes < long.forward_passes
    want = engine.generate(input_ids=list(prompts.values()), sampling_params=params)
    assert [r.output_ids for r in reqs.values()] == [w["output_ids"] for w in want]


@pytest.mark.parametrize("bad", [0, -8, 2.5])
def test_a_bad_budget_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="busy_prefill_tokens must be a positive int"):
        Engine(busy_prefill_tokens=bad, start=False)
