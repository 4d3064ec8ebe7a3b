"""lmc's engine against transformers on the same SmolLM2 weights (CPU, fp32): greedy tokens and logprobs."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, my friend.",
    "The three primary colors are",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "import numpy as np\nx = np.",
    "List of fruits:\n- apple\n- banana\n-",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "Photosynthesis is the process by which",
    "SELECT name FROM users WHERE",
    "Dear Sir or Madam,\nI am writing to",
    "The square root of 144 is",
    "Les chats sont",
    "<|im_start|>user\nWhat is the largest planet?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
    "{\"name\": \"Alice\", \"age\":",
    "Water is made of hydrogen and",
]
NEW = 12


def hf_greedy(hf_model, ids, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def hf_logprobs(hf_model, ids):
    """log p(ids[i] | ids[:i]) for i >= 1, teacher forced."""
    with torch.no_grad():
        lp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer):
    ref = []
    for p in PROMPTS:
        ids = tokenizer.encode(p)
        out = hf_greedy(hf_model, ids, NEW)
        ref.append((ids, out, hf_logprobs(hf_model, ids + out)))
    return ref


def check_against(reference, results, prompt_logprobs=True):
    for (ids, out, lps), r in zip(reference, results):
        assert r["output_ids"] == out, f"greedy tokens differ for prompt {ids[:8]}..."
        m = r["meta_info"]
        got_out = [lp for lp, _, _ in m["output_token_logprobs"]]
        assert got_out == pytest.approx(lps[len(ids) - 1:len(ids) - 1 + len(out)], abs=1e-4)
        if prompt_logprobs:
            got_in = [lp for lp, _, _ in m["input_token_logprobs"]]
            assert got_in[0] is None
            assert got_in[1:] == pytest.approx(lps[:len(ids) - 1], abs=1e-4)


def test_greedy_and_logprobs_match_transformers(engine, reference):
    engine.flush_cache()
    results = engine.generate([p for p in PROMPTS], {"max_new_tokens": NEW, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
    check_against(reference, results)


def test_same_with_warm_cache(engine, reference):
    # First pass fills the cache; the second reuses it (output logprobs only, so the whole prompt can hit).
    engine.generate(PROMPTS, {"max_new_tokens": NEW, "temperature": 0})
    results = engine.generate(PROMPTS, {"max_new_tokens": NEW, "temperature": 0}, return_logprob=True)
    assert all(r["meta_info"]["cached_tokens"] >= r["meta_info"]["prompt_tokens"] - 1 for r in results)
    check_against(reference, results, prompt_logprobs=False)


def test_64_concurrent_requests(engine, reference):
    engine.flush_cache()
    jobs = [reference[i % len(reference)] for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        futs = [pool.submit(engine.generate, None, {"max_new_tokens": NEW, "temperature": 0}, ids,
                            True, 0) for ids, _, _ in jobs]
        results = [f.result() for f in futs]
    check_against(jobs, results)
    assert engine.stats()["running"] == 0


def test_prompt_logprobs_from_an_offset_with_top_logprobs(engine, hf_model, tokenizer):
    ids = tokenizer.encode("The capital of Italy is Rome. The capital of Spain is")
    r = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0},
                        return_logprob=True, logprob_start_len=5, top_logprobs_num=3)
    m = r["meta_info"]
    ref = hf_logprobs(hf_model, ids + r["output_ids"])
    assert [lp for lp, _, _ in m["input_token_logprobs"]] == pytest.approx(ref[4:len(ids) - 1], abs=1e-4)
    assert [t for _, t, _ in m["input_token_logprobs"]] == ids[5:]
    for (lp, tok, _), top in zip(m["output_token_logprobs"], m["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == tok and top[0][0] == pytest.approx(lp)
