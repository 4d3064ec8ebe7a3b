"""CUDA-graph decode replay (lmc/runtime/cuda_graph.py) against eager execution, and overlap scheduling on the
GPU against the same engine without it: greedy tokens identical, logprobs within fp32 rounding. GPU only (a CPU
engine captures no graphs); on the lent H200 these run with the rest of the suite."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(5, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def gpu_engines():
    from lmc.runtime import Engine

    kw = dict(device="cuda", dtype="float32", max_total_tokens=4096)
    graphs = Engine("dummy:tiny", cuda_graph_max_bs=16, **kw)
    eager = Engine("dummy:tiny", cuda_graph_max_bs=0, overlap_schedule=False, **kw)
    yield graphs, eager
    graphs.shutdown()
    eager.shutdown()


def outputs(eng, ps):
    res = eng.generate(input_ids=ps, sampling_params=PARAMS, return_logprob=True)
    return [r["output_ids"] for r in res], [[lp[0] for lp in r["meta_info"]["output_token_logprobs"]] for r in res]


@pytest.mark.parametrize("batch", [1, 3, 16, 20])  # 3: a padded bucket; 20: past the largest graph, eager
def test_graph_replay_equals_eager(gpu_engines, batch):
    graphs, eager = gpu_engines
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    ps = prompts(batch, graphs.runner.cfg.vocab_size, seed=batch)
    (got_ids, got_lp), (want_ids, want_lp) = outputs(graphs, ps), outputs(eager, ps)
    assert got_ids == want_ids
    for a, b in zip(got_lp, want_lp):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    # Without logprobs sampling reads the graph's logits buffer in place (no copy): the same tokens.
    assert [r["output_ids"] for r in graphs.generate(input_ids=ps, sampling_params=PARAMS)] == want_ids


def test_overlap_on_and_off_give_the_same_greedy_tokens(gpu_engines):
    graphs, _ = gpu_engines
    ps = prompts(6, graphs.runner.cfg.vocab_size, seed=7)
    assert graphs.scheduler.overlap
    on = outputs(graphs, ps)[0]
    graphs.scheduler.overlap = False
    try:
        off = outputs(graphs, ps)[0]
    finally:
        graphs.scheduler.overlap = True
    assert on == off


def test_shared_prefix_decode_replays_a_cascade_graph(gpu_engines, monkeypatch):
    """Requests on one cached prefix replay their bucket's cascade graph (captured on first use; the prefix read
    once for the batch) and give the eager engine's tokens and logprobs, which reads the prefix per request."""
    from lmc.runtime.attention import triton_backend

    graphs, eager = gpu_engines
    monkeypatch.setattr(triton_backend, "SHARED_PREFIX_MIN_BYTES", 1)  # the tiny model's KV is too small
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, graphs.runner.cfg.vocab_size, (150,), generator=g).tolist()
    ps = [shared + q for q in prompts(6, graphs.runner.cfg.vocab_size, seed=12)]
    graphs.flush_cache()
    got_ids, got_lp = outputs(graphs, ps)
    assert graphs.runner.graphs.cascade, "no cascade graph was replayed"
    with monkeypatch.context() as m:
        m.setattr(triton_backend, "SHARED_PREFIX_MIN_BYTES", 1 << 62)  # the plain path, for the comparison
        want_ids, want_lp = outputs(eager, ps)
    assert got_ids == want_ids
    for a, b in zip(got_lp, want_lp):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def count_calls(monkeypatch, obj, name: str) -> list[int]:
    """The number of tokens (the first argument's length) of every call of obj.name from now on."""
    calls, real = [], getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda ids, *a: calls.append(len(ids)) or real(ids, *a))
    return calls


def cached_prefix(engines, n: int, seed: int) -> tuple[list[int], torch.Generator]:
    """n random tokens, computed and cached in every engine (flushed first), and the generator that made them."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, engines[0].runner.cfg.vocab_size, (n,), generator=g).tolist()
    for eng in engines:
        eng.flush_cache()
        eng.generate(input_ids=shared, sampling_params=EXTEND_PARAMS)
    return shared, g


EXTEND_PARAMS = {**PARAMS, "max_new_tokens": 4}


def extend_outputs(eng, shared: list[int], suffixes: list[list[int]]) -> list[tuple[list, list, list]]:
    """Per request shared + suffix, in one generate call: output ids, their logprobs, the prompt logprobs from the
    prefix's last token on (so its logits are asked for again: it is in the extend too)."""
    res = eng.generate(input_ids=[shared + q for q in suffixes], sampling_params=EXTEND_PARAMS, return_logprob=True,
                       logprob_start_len=len(shared) - 1)
    return [(r["output_ids"], [lp[0] for lp in r["meta_info"]["output_token_logprobs"]],
             [lp[0] for lp in r["meta_info"]["input_token_logprobs"] if lp[0] is not None]) for r in res]


def assert_same_outputs(got, want, min_prompt_logprobs: int) -> None:
    for (gi, go, gin), (wi, wo, win) in zip(got, want, strict=True):
        assert gi == wi and len(gin) == len(win) >= min_prompt_logprobs
        assert max(abs(x - y) for x, y in zip(go + gin, wo + win)) < 1e-4


def test_small_extends_replay_graphs_and_equal_eager(gpu_engines, monkeypatch):
    """A few new tokens on a cached prefix (a program's text between two calls) replay their bucket's extend graph,
    one decode row per new token (cuda_graph.py), and give the eager engine's tokens, sampled logprobs and prompt
    logprobs; one request at a time, so each extend is its request's alone."""
    graphs, eager = gpu_engines
    replays = count_calls(monkeypatch, graphs.runner.graphs, "replay_extend")
    shared, g = cached_prefix(gpu_engines, 120, seed=21)
    vocab = graphs.runner.cfg.vocab_size
    for k in (1, 3, 7, 12):
        q = torch.randint(3, vocab, (k,), generator=g).tolist()
        n = len(replays)
        got, want = extend_outputs(graphs, shared, [q]), extend_outputs(eager, shared, [q])
        # one extend (its new tokens, and the prefix's last one where its logits are asked again), then decodes
        assert len(replays) == n + 1 and replays[n] >= k, f"no extend graph replayed: {replays[n:]}"
        assert_same_outputs(got, want, k)


def test_extends_past_the_largest_bucket_replay_in_chunks_and_equal_eager(gpu_engines, monkeypatch):
    """An extend of more new tokens than the largest bucket (16 here) replays the extend graphs chunk after chunk:
    one request's 40 new tokens, then 4 requests' 14 each in one forward (what a compiled program's next calls are),
    with the eager engine's tokens, sampled logprobs and prompt logprobs."""
    graphs, eager = gpu_engines
    chunks = count_calls(monkeypatch, graphs.runner.graphs, "_replay_chunk")
    shared, g = cached_prefix(gpu_engines, 100, seed=31)
    vocab = graphs.runner.cfg.vocab_size
    for k, n in ((40, 1), (14, 4)):
        qs = [torch.randint(3, vocab, (k,), generator=g).tolist() for _ in range(n)]
        del chunks[:]
        got, want = extend_outputs(graphs, shared, qs), extend_outputs(eager, shared, qs)
        assert chunks[:2] == [16, 16], f"the extend did not replay in chunks: {chunks}"
        assert_same_outputs(got, want, k)
