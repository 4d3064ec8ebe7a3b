"""Engine behaviour on the embedded model: request options, bad input, caching, async, flush."""
import asyncio

import pytest

from lmc.runtime import Engine, RequestError, UnknownModelError

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownModelError) as e:
        Engine("no-such-model")
    assert "no-such-model" in str(e.value) and "smollm2-135m-instruct" in str(e.value) and "dummy:tiny" in str(e.value)
    with pytest.raises(UnknownModelError, match="known shapes"):
        Engine("dummy:llama-9-99b")


def test_unknown_dtype_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'.*bfloat16"):
        Engine("dummy:tiny", dtype="fp8")


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0.0), ("top_k", 0), ("min_p", 2),
                                         ("max_new_tokens", -3), ("frequency_penalty", 5), ("seed", "x"),
                                         ("min_new_tokens", 99), ("stop", [""])])
def test_invalid_sampling_value_names_the_field(engine, field, value):
    with pytest.raises(RequestError, match=field):
        engine.generate("hi", {"max_new_tokens": 4, field: value})


def test_unknown_sampling_field_is_named(engine):
    with pytest.raises(RequestError, match="temprature"):
        engine.generate("hi", {"temprature": 0})


def test_too_long_prompt_fails_alone(engine, tokenizer):
    long_ids = [tokenizer.encode("a")[0]] * (engine.context_length + 5)
    with pytest.raises(RequestError, match="context length"):
        engine.generate(input_ids=long_ids, sampling_params=GREEDY)
    ok = tokenizer.encode("The capital of France is")
    out = engine.generate(input_ids=[ok, long_ids, ok], sampling_params=GREEDY)
    assert out[0]["output_ids"] == out[2]["output_ids"] and len(out[0]["output_ids"]) > 0
    assert "context length" in out[1]["error"] and out[1]["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(RequestError, match="input_ids must be in"):
        engine.generate(input_ids=[10**9], sampling_params=GREEDY)


def test_prefill_only_returns_prompt_logprobs(engine, tokenizer):
    ids = tokenizer.encode("One two three four")
    r = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                        logprob_start_len=0)
    m = r["meta_info"]
    assert r["output_ids"] == [] and m["finish_reason"] == {"type": "length", "length": 0}
    assert len(m["input_token_logprobs"]) == len(ids) and m["input_token_logprobs"][0][0] is None
    assert all(lp < 0 for lp, _, _ in m["input_token_logprobs"][1:])


def test_token_ids_logprob_scores_chosen_ids_at_each_output_position(engine, tokenizer):
    ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" three", " four", " apple")]
    r = engine.generate("One two", {"max_new_tokens": 3, "temperature": 0}, return_logprob=True,
                        token_ids_logprob=ids)
    m = r["meta_info"]
    assert len(m["output_token_ids_logprobs"]) == 3
    for (lp, tid, _), row in zip(m["output_token_logprobs"], m["output_token_ids_logprobs"]):
        assert [t for _, t, _ in row] == ids and all(x <= 0 for x, _, _ in row)
        if tid in ids:  # the sampled token's own logprob agrees with its score in the list
            assert row[ids.index(tid)][0] == pytest.approx(lp, abs=1e-5)
    with pytest.raises(RequestError, match="token_ids_logprob"):
        engine.generate("x", {"max_new_tokens": 1}, return_logprob=True, token_ids_logprob=[10**9])


def test_stop_string_and_stop_token(engine):
    r = engine.generate("Count: 1, 2, 3, 4,", {"max_new_tokens": 20, "temperature": 0, "stop": " 7"})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 7"}
    assert r["text"].strip() == "5, 6,"
    first = engine.generate("Count: 1, 2, 3, 4,", {"max_new_tokens": 20, "temperature": 0})["output_ids"]
    r = engine.generate("Count: 1, 2, 3, 4,", {"max_new_tokens": 20, "temperature": 0,
                                               "stop_token_ids": [first[2]]})
    assert r["output_ids"] == first[:3] and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2]}


def test_eos_and_ignore_eos_and_min_tokens(engine):
    chat = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"
    r = engine.generate(chat, {"max_new_tokens": 40, "temperature": 0})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    n = len(r["output_ids"])
    r2 = engine.generate(chat, {"max_new_tokens": n + 5, "temperature": 0, "ignore_eos": True})
    assert len(r2["output_ids"]) == n + 5 and r2["meta_info"]["finish_reason"]["type"] == "length"
    r3 = engine.generate(chat, {"max_new_tokens": n + 5, "temperature": 0, "min_new_tokens": n + 2})
    assert len(r3["output_ids"]) >= n + 2 and 2 not in r3["output_ids"][:n + 1]


def test_seeded_sampling_is_reproducible(engine):
    p = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "min_p": 0.01}
    a = engine.generate("My favourite animal is", {**p, "seed": 7})
    b = engine.generate(["My favourite animal is"] * 2, [{**p, "seed": 7}, {**p, "seed": 8}])
    assert a["output_ids"] == b[0]["output_ids"]
    outs = {tuple(engine.generate("My favourite animal is", {**p, "seed": s})["output_ids"]) for s in range(6)}
    assert len(outs) > 1, "different seeds should sample different continuations"


def test_top_k_1_is_greedy_and_penalties_change_output(engine):
    g = engine.generate("1, 2, 1, 2, 1, 2,", {"max_new_tokens": 10, "temperature": 0})["output_ids"]
    k1 = engine.generate("1, 2, 1, 2, 1, 2,", {"max_new_tokens": 10, "temperature": 0.8, "top_k": 1})["output_ids"]
    assert g == k1
    pen = engine.generate("1, 2, 1, 2, 1, 2,", {"max_new_tokens": 10, "temperature": 0,
                                               "frequency_penalty": 2.0, "presence_penalty": 2.0})["output_ids"]
    assert pen != g and len(set(pen)) > len(set(g))


def test_prefix_cache_hits_and_flush(engine):
    engine.flush_cache()
    assert engine.stats()["cached_slots"] == 0
    prefix = "A long shared system prompt about geography and capitals. " * 5
    a = engine.generate(prefix + "France?", GREEDY)
    b = engine.generate(prefix + "Spain?", GREEDY)
    assert a["meta_info"]["cached_tokens"] == 0
    assert b["meta_info"]["cached_tokens"] >= len(engine.tokenizer.encode(prefix)) - 2
    assert engine.flush_cache() and engine.stats()["cached_slots"] == 0
    c = engine.generate(prefix + "Spain?", GREEDY)
    assert c["meta_info"]["cached_tokens"] == 0 and c["output_ids"] == b["output_ids"]


def test_a_batch_shares_a_prefix_beyond_what_is_cached(engine):
    """Requests that already match a cached header still share the longer prefix a batch-mate computes in the same
    step: one computes it, the others wait a step and find it cached (SGLang checks only requests with <= 32 cached
    tokens, which recomputes it per request)."""
    engine.flush_cache()
    header = "System: you answer questions about geography and capitals of the world. " * 3
    engine.generate(header + "Warm-up.", GREEDY)
    block = "Examples: France has Paris. Spain has Madrid. Italy has Rome. Japan has Tokyo. Peru has Lima. " * 2
    outs = engine.generate([header + block + q for q in ("Chile?", "Kenya?", "Nepal?", "Ghana?")], GREEDY)
    n_header, n_block = (len(engine.tokenizer.encode(t)) for t in (header, header + block))
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] >= n_header - 2, cached  # the first one computes the block on top of the cached header
    assert all(c >= n_block - 2 for c in cached[1:]), (cached, n_block)  # the others find the block cached


def test_async_generate_batches_tasks(engine):
    async def main():
        prompts = [f"Item {i}: the color of the sky is" for i in range(6)]
        return await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 6 and all(len(r["output_ids"]) == 8 for r in results)
    single = engine.generate("Item 3: the color of the sky is", GREEDY)
    assert results[3]["output_ids"] == single["output_ids"]
