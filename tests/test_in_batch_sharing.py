"""In-batch prefix sharing (scheduler/prefill.py): requests queued together compute a prefix they share once, even
when it is only a few tokens beyond what is cached (a fork's commit and its branches: tree_of_thought), and
requests whose shared positions need their logits anyway (a select's choices) are not held back for it."""

HEADER = "System: you answer questions about geography and capitals of the world. " * 3
PROMPT = HEADER + "Question: which river runs through the capital city of this country?"
GREEDY = {"max_new_tokens": 2, "temperature": 0}


def fork_branches(engine):
    """A fork as a compiled program sends it: the prefix's commit (prefill only) and its branches at once, the
    prefix extending a cached header by fewer tokens than SGLang's 32-token deferral rule."""
    engine.flush_cache()
    engine.generate(HEADER + "Warm-up.", GREEDY)
    outs = engine.generate([PROMPT, PROMPT + " Answer A:", PROMPT + " Answer B:"],
                           [{"max_new_tokens": 0}, GREEDY, GREEDY])
    n_header, n_prompt = (len(engine.tokenizer.encode(t)) for t in (HEADER, PROMPT))
    assert n_prompt - n_header < 32
    return [o["meta_info"]["cached_tokens"] for o in outs], n_header, n_prompt


def test_fork_branches_share_the_prefix_their_commit_computes(engine):
    cached, n_header, n_prompt = fork_branches(engine)
    assert cached[0] >= n_header - 2  # the commit computes the question on top of the cached header
    assert all(c >= n_prompt for c in cached[1:]), (cached, n_prompt)  # the branches find it cached


def test_select_choices_are_scored_in_one_forward(engine):
    """Choices scored from two tokens before the prompt's end recompute those positions whatever is cached: no
    choice waits for another's (three choices, one prefill forward)."""
    engine.flush_cache()
    engine.generate(PROMPT, {"max_new_tokens": 0})
    start = len(engine.tokenizer.encode(PROMPT)) - 2
    before = engine.stats()["prefill_forwards"]
    outs = engine.generate([PROMPT + c for c in (" the river Seine", " the river Thames", " the river Danube")], {"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=start)
    assert engine.stats()["prefill_forwards"] - before == 1
    assert all(o["meta_info"]["cached_tokens"] >= start - 1 for o in outs)
