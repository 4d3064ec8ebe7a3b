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
