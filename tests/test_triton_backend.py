"""The Triton attention backend end to end: the real model through the engine (prefill, prefix-cache hit, decode)
gives the torch backend's tokens and logprobs. On CPU the kernels run under TRITON_INTERPRET=1 (conftest)."""
import pytest

pytest.importorskip("triton")

from lmc.runtime import Engine  # noqa: E402


@pytest.fixture(scope="module")
def triton_engine():
    # fp32 as the session engine it is compared with (conftest), on a GPU too
    eng = Engine(attention_backend="triton", dtype="float32", max_total_tokens=2048, check_invariants=True)
    yield eng
    eng.shutdown()


def test_triton_backend_matches_torch_backend(triton_engine, engine):
    prompts = ["The capital of France is", "The capital of France is Paris. The capital of Italy is"]
    params = {"max_new_tokens": 2, "temperature": 0}  # one prefill and one decode step each: the interpreter is slow
    for p in prompts:  # the second prompt extends the first one's cached prefix
        got = triton_engine.generate(p, params, return_logprob=True, logprob_start_len=0)
        want = engine.generate(p, params, return_logprob=True, logprob_start_len=0)
        assert got["output_ids"] == want["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            a = [lp for lp, _, _ in got["meta_info"][key] if lp is not None]
            b = [lp for lp, _, _ in want["meta_info"][key] if lp is not None]
            assert a == pytest.approx(b, abs=1e-4)
    hit = triton_engine.generate(prompts[1], params)
    assert hit["meta_info"]["cached_tokens"] > 0 and hit["output_ids"] == want["output_ids"]


def test_shared_prefix_decode_matches_torch_backend(triton_engine, engine, monkeypatch):
    """Requests on one cached prefix decode through the cascade (the prefix read once for the batch) and give the
    torch backend's tokens and logprobs."""
    from lmc.runtime.attention import triton_backend

    monkeypatch.setattr(triton_backend, "SHARED_PREFIX_MIN_BYTES", 1)  # the embedded model's KV is too small
    prefixes = []
    plain = triton_backend.decode_attention

    def recording(*args, shared_prefix=0, **kw):
        prefixes.append(shared_prefix)
        return plain(*args, shared_prefix=shared_prefix, **kw)

    monkeypatch.setattr(triton_backend, "decode_attention", recording)
    shared = "Answer every question in one short sentence, and do not repeat the question. Question: "
    prompts = [shared + q for q in ("What is two plus two?", "Name a primary color.", "Who wrote Hamlet?")]
    params = {"max_new_tokens": 2, "temperature": 0}  # a decode step of the requests that share (interpreter: slow)
    triton_engine.flush_cache()
    got = triton_engine.generate(prompts, params, return_logprob=True)
    want = engine.generate(prompts, params, return_logprob=True)
    assert max(prefixes) >= 16  # the shared instruction's tokens (at least), read once for the batch
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        a = [lp for lp, _, _ in g["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _, _ in w["meta_info"]["output_token_logprobs"]]
        assert a == pytest.approx(b, abs=1e-4)


def test_cache_manager_finds_the_batch_shared_prefix():
    """CacheManager.shared_prefix: the leading positions whose slots agree in every row, within every request's
    tree-owned (cache-protected) part; 0 for one request or unrelated ones."""
    import torch

    from lmc.runtime.core import Req, SamplingParams
    from lmc.runtime.scheduler.cache import CacheManager

    mem = CacheManager(num_rows=6, context_length=16, num_slots=64)
    reqs = []
    for row, own in ((1, [30, 31, 32]), (2, [40, 41]), (3, [50, 51, 52, 53])):
        r = Req(input_ids=[0] * 10, params=SamplingParams())
        r.row, r.cache_protected_len = row, 5 + len(own)
        mem.table[row, :5 + len(own)] = torch.tensor([7, 8, 9, 10, 11] + own, dtype=torch.int32)
        reqs.append(r)
    assert mem.shared_prefix(reqs) == 5
    assert mem.shared_prefix(reqs[:1]) == 0
    reqs[1].cache_protected_len = 3  # past it, request 2's positions are its own: they cannot count
    assert mem.shared_prefix(reqs) == 3
    searches = []
    mem._search_shared = lambda rows, n, search=mem._search_shared: searches.append(n) or search(rows, n)
    assert [mem.shared_prefix(reqs) for _ in range(3)] == [3] * 3 and searches == []  # a decode loop: kept
    mem.table[3, 0] = 12  # a request on another prompt (its admission writes the row below its new tokens)
    mem._written(3, 0, 1)
    assert mem.shared_prefix(reqs) == 0 and searches == [3]
