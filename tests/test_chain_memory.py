"""A chain request's KV under memory pressure: admission reserves what a running chain will still add (its later
texts and calls, continuation.Chain.tokens_after), and a lone running request is not aborted for memory while
chains between two calls hold KV (they go back to the queue first)."""
import lmc
from lmc.runtime import continuation
from lmc.runtime.core import Req, SamplingParams
from lmc.runtime.engine import Engine
from lmc.runtime.scheduler import prefill
from lmc.runtime.scheduler.config import CLIP_NEW_TOKENS


@lmc.function
def long_chain(s, topic):
    s += "Topic: " + topic + "\n"
    for i in range(4):
        s += f"Fact {i + 1}:" + lmc.gen(f"fact{i}", max_tokens=16, ignore_eos=True) + "\n"


TOPICS = [{"topic": t} for t in ("the moon", "the sun", "Mars", "the sea")]


def test_admission_counts_a_chains_later_steps():
    steps = [continuation.ChainStep("Topic: the moon\nFact 1:", gen=SamplingParams(max_new_tokens=6)),
             continuation.ChainStep("\nIs it true? ", choices=["yes", "no"], method=lmc.token_length_normalized),
             continuation.ChainStep("\nFact 2:", gen=SamplingParams(max_new_tokens=8))]
    chain = continuation.Chain(steps, steps[0].text)
    # "\nIs it true? ": 13 characters -> 3 tokens, its choice 1; "\nFact 2:": 8 -> 2, its gen 8
    assert chain.tokens_after == [3 + 1 + 2 + 8, 2 + 8, 0]
    r = Req(input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=6))
    assert prefill.est_new(r) == 6  # a plain request: its own call
    r.chain, r.output_ids = chain, [5, 6]
    assert prefill.est_new(r) == 4 + 14
    chain.at = 1
    assert prefill.est_new(r) == 4 + 10
    r.params = SamplingParams(max_new_tokens=CLIP_NEW_TOKENS)
    assert prefill.est_new(r) == CLIP_NEW_TOKENS
    # a fork's branches run as requests of their own: the parent adds nothing after its last call
    branch = [continuation.ChainStep("\nIdea:", gen=SamplingParams(max_new_tokens=50))]
    forked = continuation.Chain(steps[:1] + [continuation.ChainStep("", branches=[branch, branch])], steps[0].text)
    assert forked.tokens_after == [0, 0]


def _optimistic(r):
    """Test double of admission's estimate before chains counted their later steps: the running call's tokens only
    (over-admits chains, so that decode runs short of memory while chains wait between two calls)."""
    return min(r.params.max_new_tokens - len(r.output_ids), CLIP_NEW_TOKENS)


def test_a_lone_running_request_outlasts_waiting_chains(engine, monkeypatch):
    expected = [s.variables() for s in long_chain.compile().run_batch(TOPICS, backend=lmc.Local(engine=engine),
                                                                        temperature=0)]
    monkeypatch.setattr(prefill, "est_new", _optimistic)
    tight = Engine(max_total_tokens=200, check_invariants=True)
    try:
        states = long_chain.compile().run_batch(TOPICS, backend=lmc.Local(engine=tight), temperature=0)
        assert [s.error() for s in states] == [None] * len(TOPICS)
        assert [s.variables() for s in states] == expected
        assert tight.scheduler.stats["retractions"] > 0  # memory did run short
    finally:
        tight.shutdown()
