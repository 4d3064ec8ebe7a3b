"""Jump-forward constrained decoding: forced strings are appended without sampling, retokenized so the output ids
stay canonical, with the matcher and the KV rolled back to the first changed token.

The validity sweep samples every grammar of `constrained_corpus.py` at temperature 1.0 with jump-forward on and
off. CI runs LMC_CORPUS_SAMPLES (default 4) samples per grammar; `benchmarks/jump_forward_bench.py --validity`
runs the sweep with --samples per grammar (20 by default: 2,080 generations); benchmarks/RESULTS.md records the
last run with its sample count.

The session engine runs with check_invariants=True, so the scheduler also asserts after every jump that the
output ids equal the tokenizer's canonical encoding of the output text (`canonical_checks` counts them), besides
the slot-accounting invariant after every step.
"""
import json
import os
import re
from contextlib import contextmanager

import jsonschema
import pytest

from constrained_corpus import REGEXES, SCHEMAS, chat
from lmc.runtime import Engine
from lmc.runtime.core import SamplingParams

SAMPLES = int(os.environ.get("LMC_CORPUS_SAMPLES", "4"))
EOS = 2


@contextmanager
def jump_forward(engine, on: bool):
    """Switch jump-forward on the shared engine between requests (it is idle then), restoring it after."""
    before = engine.scheduler.enable_jump_forward
    engine.scheduler.enable_jump_forward = on
    try:
        yield
    finally:
        engine.scheduler.enable_jump_forward = before


def sweep(engine, kind: str, corpus, samples: int):
    """Every grammar x `samples` seeds, all in one batch (they run concurrently)."""
    prompts, params, grammars = [], [], []
    for name, question, grammar, max_new in corpus:
        for seed in range(samples):
            prompts.append(chat(question))
            params.append({"max_new_tokens": max_new, "temperature": 1.0, "seed": seed, kind: grammar})
            grammars.append((name, grammar))
    return grammars, engine.generate(prompts, params)


def valid(kind: str, grammar, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(grammar, text) is not None
    try:
        jsonschema.validate(json.loads(text), grammar)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_corpus_size_and_coverage():
    assert len(REGEXES) >= 25 and len(SCHEMAS) >= 25
    assert len({n for n, *_ in REGEXES}) == len(REGEXES) and len({n for n, *_ in SCHEMAS}) == len(SCHEMAS)
    text = json.dumps([s for _, _, s, _ in SCHEMAS])
    for keyword in ('"minItems"', '"maxItems"', '"enum"', '"minimum"', '"maximum"', '"pattern"', '"maxLength"',
                    '"$ref"', '"anyOf"', '"const"'):
        assert keyword in text, keyword
    nested = [n for n, _, s, _ in SCHEMAS if json.dumps(s).count('"type": "object"') >= 2 or "$ref" in json.dumps(s)]
    optional = [n for n, _, s, _ in SCHEMAS if set(s.get("properties", {})) - set(s.get("required", []))]
    assert len(nested) >= 3 and len(optional) >= 2


@pytest.mark.parametrize("jf", [True, False], ids=["jump_forward_on", "jump_forward_off"])
@pytest.mark.parametrize("kind,corpus", [("regex", REGEXES), ("json_schema", SCHEMAS)], ids=["regex", "schema"])
def test_corpus_validity(engine, kind, corpus, jf):
    checks = engine.stats()["canonical_checks"]
    with jump_forward(engine, jf):
        grammars, outs = sweep(engine, kind, corpus, SAMPLES)
    finished = 0
    for (name, grammar), r in zip(grammars, outs):
        assert "error" not in r, (name, r.get("error"))
        reason = r["meta_info"]["finish_reason"]
        if reason["type"] == "stop":
            finished += 1
            assert reason["matched"] == EOS and r["output_ids"][-1] == EOS, (name, r)
            assert valid(kind, grammar, r["text"]), (name, r["text"])
        else:
            assert reason["type"] == "length", (name, reason)
    assert finished >= 0.95 * len(outs), f"only {finished}/{len(outs)} finished: raise max_new_tokens"
    jumped = sum(r["meta_info"]["jump_forward_tokens"] for r in outs)
    if jf:
        assert jumped > 0 and engine.stats()["canonical_checks"] > checks
    else:
        assert jumped == 0 and all(r["meta_info"]["jumps"] == 0 for r in outs)


def test_after_every_jump_the_output_ids_are_canonical(engine, tokenizer):
    """Hook the scheduler's jump: record the output ids after each one and compare, in the test, with the
    tokenizer's encoding of the decoded text. Some jumps must have rolled back sampled tokens."""
    seen = []
    sched = engine.scheduler
    inner = sched._jump_forward

    def hooked(r):
        status = inner(r)
        if status is not None and (r.finish_reason or {}).get("type") != "length":
            ids = r.output_ids[:-1] if r.output_ids[-1:] == [EOS] and r.finished else list(r.output_ids)
            seen.append(ids)
        return status

    sched._jump_forward = hooked
    try:
        with jump_forward(engine, True):
            picked = [c for c in SCHEMAS if c[0] in ("capital", "nested", "array_of_objects", "optional_fields")]
            _, outs = sweep(engine, "json_schema", picked, 3)
            picked = [c for c in REGEXES if c[0] in ("name", "json_pair", "word_list", "email")]
            _, outs2 = sweep(engine, "regex", picked, 3)
    finally:
        del sched._jump_forward
    assert len(seen) > 20
    for ids in seen:
        assert ids == tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False), ids
    assert sum(r["meta_info"]["retokenized_tokens"] for r in outs + outs2) > 0, "no jump exercised a rollback"


def test_retokenize_rolls_back_to_the_first_changed_token(engine, tokenizer):
    """The notes' worked example: the model spelled `Al` `ice` `"`; the forced `, "age": ` re-merges them into
    `Alice` `",` ... so the matcher rolls back 3 tokens, not 1."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    m = engine.grammars.matcher(SamplingParams(json_schema=schema))
    jf = engine.grammars.jump_forward()
    k, out = jf.jump(m, [], 0)
    # The forced `{"name": "` ends in `Ġ"`, which a string starting with `$` would extend (`Ġ"$`): held back.
    assert k == 0 and tokenizer.decode(out) == '{"name":'
    sampled = [tokenizer.convert_tokens_to_ids(t) for t in ('Ġ"', "Al", "ice", '"')]
    for t in sampled:
        assert m.accept_token(t)
    old = out + sampled
    k, new = jf.jump(m, old, len(out))
    assert k == len(out) + 1 and len(old) - k == 3
    assert tokenizer.decode(new) == '{"name": "Alice", "age":'  # `Ġ` held: the grammar allows `Ġ-` next
    assert new == tokenizer.encode(tokenizer.decode(new), add_special_tokens=False)
    assert m.accept_string(" 30}") and m.is_completed()


def test_trailing_token_is_held_when_the_grammar_could_extend_it(engine, tokenizer):
    """`The answer is ` ends in a lone space token; the grammar allows ` Paris` next, so the space is left for the
    model to sample together with the word (MLC's rule) instead of forcing a boundary BPE would not make."""
    m = engine.grammars.matcher(SamplingParams(regex=r"The answer is [A-Z][a-z]{2,10}\."))
    k, out = engine.grammars.jump_forward().jump(m, [], 0)
    assert tokenizer.decode(out) == "The answer is"
    assert m.accept_token(tokenizer.convert_tokens_to_ids("ĠParis"))


def test_meta_info_and_fewer_forward_passes(engine):
    regex = (r'\{"name": "[A-Za-z ]{1,12}", "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)", '
             r'"alive": (true|false)\}')
    params = {"max_new_tokens": 80, "temperature": 0, "regex": regex}
    q = chat("Describe a Harry Potter character as JSON.")
    with jump_forward(engine, True):
        on = engine.generate(q, params)
    with jump_forward(engine, False):
        off = engine.generate(q, params)
    for r in (on, off):
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS} and re.fullmatch(regex, r["text"])
    mo, mf = on["meta_info"], off["meta_info"]
    assert mo["jump_forward_tokens"] >= 15 and mo["jumps"] >= 3
    assert mf["jump_forward_tokens"] == 0 and mf["jumps"] == 0
    assert mf["forward_passes"] == len(off["output_ids"])  # off: one forward per token
    assert mo["forward_passes"] <= 0.6 * mf["forward_passes"]
    assert mo["forward_passes"] + mo["jump_forward_tokens"] - mo["retokenized_tokens"] >= len(on["output_ids"])


def test_fully_forced_output_needs_no_forward(engine, tokenizer):
    params = {"max_new_tokens": 20, "temperature": 1.0, "regex": "Hello, World!"}
    with jump_forward(engine, True):
        on = engine.generate("Say hi:", params)
    assert on["text"] == "Hello, World!" and on["meta_info"]["forward_passes"] == 0
    assert on["output_ids"] == tokenizer.encode("Hello, World!", add_special_tokens=False) + [EOS]
    assert on["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    with jump_forward(engine, False):
        off = engine.generate("Say hi:", params)
    assert off["text"] == "Hello, World!" and off["meta_info"]["forward_passes"] == len(off["output_ids"])


def test_forced_text_respects_max_new_tokens_and_stop_strings(engine, tokenizer):
    regex = r"The quick brown fox jumps over the lazy dog [0-9]"
    with jump_forward(engine, True):
        r = engine.generate("x", {"max_new_tokens": 4, "regex": regex})
        assert len(r["output_ids"]) == 4 and r["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert r["output_ids"] == tokenizer.encode("The quick brown fox", add_special_tokens=False)
        r = engine.generate("x", {"max_new_tokens": 20, "regex": regex, "stop": "fox"})
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "fox"}
        assert r["text"] == "The quick brown "


def test_logprobs_stay_aligned_with_output_ids(engine):
    regex = r'\{"answer": "(yes|no)", "sure": (true|false)\}'
    with jump_forward(engine, True):
        r = engine.generate(chat("Is the sky blue?"), {"max_new_tokens": 30, "temperature": 0, "regex": regex},
                            return_logprob=True, top_logprobs_num=2)
    m = r["meta_info"]
    assert m["jump_forward_tokens"] > 0
    assert len(m["output_token_logprobs"]) == len(r["output_ids"]) == len(m["output_top_logprobs"])
    assert [t for _, t, _ in m["output_token_logprobs"]] == r["output_ids"]
    forced = [lp for lp, _, _ in m["output_token_logprobs"] if lp is None]
    assert 0 < len(forced) < len(r["output_ids"])  # forced tokens carry none; sampled ones keep theirs


def test_prompt_boundary_is_kept(engine, tokenizer):
    """The prompt ends in `{` and the output starts with the forced `"`: encoding them together would fuse them
    into one `{"` token. The output is tokenized on its own; the prompt's ids stay as given."""
    prompt = 'Answer as JSON: {'
    assert tokenizer.encode(prompt + '"a"')[:len(tokenizer.encode(prompt))] != tokenizer.encode(prompt)
    with jump_forward(engine, True):
        r = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "regex": r'"a": [0-9]\}'})
    assert re.fullmatch(r'"a": [0-9]\}', r["text"]) and r["meta_info"]["prompt_tokens"] == len(tokenizer.encode(prompt))
    assert r["output_ids"][:-1] == tokenizer.encode(r["text"], add_special_tokens=False)


def test_streaming_a_jumping_request(engine):
    regex = r'\{"city": "[A-Za-z]{1,10}", "country": "(France|Japan|Peru)"\}'
    with jump_forward(engine, True):
        chunks = list(engine.stream(chat("Describe a city as JSON."),
                                    {"max_new_tokens": 40, "temperature": 0, "regex": regex}))
    text = "".join(c["text"] for c in chunks)
    assert re.fullmatch(regex, text) and len(chunks) > 2
    assert chunks[-1]["meta_info"]["jumps"] > 0 and chunks[-1]["output_ids"][-1] == EOS


def test_mixed_free_and_constrained_batch_with_jumps(engine):
    """Jumped requests re-prefill while free requests decode in the same forward: the free requests' greedy
    outputs are those they get alone."""
    free = {"max_new_tokens": 16, "temperature": 0}
    q = chat("Tell me about Paris.")
    alone = engine.generate(q, free)["output_ids"]
    regex = r'\{"city": "[A-Za-z]{1,10}", "country": "[A-Za-z]{1,10}", "population": [0-9]{1,8}\}'
    with jump_forward(engine, True):
        mixed = engine.stats()["mixed_forwards"]
        outs = engine.generate([q, chat("Describe a city as JSON."), q, chat("Another city as JSON.")],
                               [free, {"max_new_tokens": 60, "temperature": 1.0, "seed": 1, "regex": regex}, free,
                                {"max_new_tokens": 60, "temperature": 1.0, "seed": 2, "regex": regex}])
        assert engine.stats()["mixed_forwards"] > mixed
    assert outs[0]["output_ids"] == alone and outs[2]["output_ids"] == alone
    assert all(re.fullmatch(regex, outs[i]["text"]) for i in (1, 3))


@pytest.fixture(scope="module")
def tight():
    """A 200-slot KV pool, 16-token chunks, at most 4 running: jumps meet eviction, chunking and retraction.
    Built with jump-forward off (the constructor switch); tests turn it on."""
    eng = Engine(max_total_tokens=200, chunked_prefill_size=16, max_running_requests=4, check_invariants=True,
                 enable_jump_forward=False)
    yield eng
    eng.shutdown()


def test_jumps_under_a_tiny_pool_match_a_roomy_engine(tight, engine):
    regex = r'\{"name": "[A-Za-z ]{1,12}", "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)"\}'
    prompts = [chat(f"Describe character number {i} as JSON.") for i in range(6)]
    params = {"max_new_tokens": 40, "temperature": 0, "regex": regex}
    off = tight.generate(prompts, params)
    assert all(r["meta_info"]["jumps"] == 0 for r in off), "the constructor switch turned jump-forward off"
    with jump_forward(tight, True), jump_forward(engine, True):
        got = tight.generate(prompts, params)
        want = engine.generate(prompts, params)
    for g, w in zip(got, want):
        assert "error" not in g, g.get("error")
        assert g["meta_info"]["jumps"] > 0 and re.fullmatch(regex, g["text"])
        assert g["output_ids"] == w["output_ids"]
    s = tight.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["free_slots"] + s["cached_slots"] == s["total_slots"]
