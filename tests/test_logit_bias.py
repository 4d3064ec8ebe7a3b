"""OpenAI's `logit_bias`: on the engine, through `lmc serve` (driven by the `openai` client), and as the last-resort
lowering of select / typed gens / regexes in `lmc.OpenAI` (logit-bias stepping), against a real server on loopback."""
import json

import openai
import pytest

import lmc
from lmc.backend.logit_bias import MAX_BIAS_TOKENS, Stepper, Vocabulary
from lmc.backend.openai import UnsupportedOnEndpoint, program_usage
from lmc.frontend.primitives import GenParams
from lmc.runtime.core import RequestError, SamplingParams

from conftest import API_KEY as KEY

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _backend(srv, tokenizer=None, **kw):
    return lmc.OpenAI("smollm2", base_url=srv.url + "/v1", api_key=KEY, constraints="logit_bias",
                      tokenizer=tokenizer, **kw)


def _prog(*parts):
    """A program that appends `parts` (strings and expressions) in order."""
    @lmc.function
    def prog(s):
        for x in parts:
            s += x

    return prog


def _id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


# ---- the engine ------------------------------------------------------------------------------------------------
def test_sampling_params_validate_logit_bias():
    assert SamplingParams.from_dict({"logit_bias": {"12": 5, 7: -100.0}}).logit_bias == {12: 5.0, 7: -100.0}
    assert SamplingParams.from_dict({"logit_bias": {}}).logit_bias is None
    for bad, msg in (({"x": 1}, "not a token id"), ({"-3": 1}, "not a token id"), ({"1": 100.5}, r"\[-100, 100\]"),
                     ({"1": float("nan")}, r"\[-100, 100\]"), ({"1": True}, r"\[-100, 100\]"), ([1], "map")):
        with pytest.raises(RequestError, match="logit_bias.*" + msg):
            SamplingParams.from_dict({"logit_bias": bad})


def test_engine_applies_each_requests_bias_in_one_batch(engine, tokenizer):
    greedy = {"max_new_tokens": 2, "temperature": 0}
    zebra, apple = _id(tokenizer, " zebra"), _id(tokenizer, " apple")
    plain, forced_z, forced_a = engine.generate(
        [PROMPT] * 3, [greedy, {**greedy, "logit_bias": {zebra: 100}}, {**greedy, "logit_bias": {str(apple): 100}}])
    assert forced_z["output_ids"] == [zebra, zebra] and forced_a["output_ids"] == [apple, apple]
    assert plain["output_ids"][0] not in (zebra, apple)
    banned = engine.generate(PROMPT, {**greedy, "logit_bias": {plain["output_ids"][0]: -100}})
    assert banned["output_ids"][0] != plain["output_ids"][0]
    with pytest.raises(RequestError, match="logit_bias: token id 10000000 is outside the model's vocabulary"):
        engine.generate(PROMPT, {**greedy, "logit_bias": {10000000: 1}})
    # a bias never lifts a constraint: the grammar still decides
    r = engine.generate(PROMPT, {**greedy, "regex": "[0-9]", "logit_bias": {zebra: 100}})
    assert r["text"].isdigit()


# ---- the server ------------------------------------------------------------------------------------------------
def test_server_honours_logit_bias(client, engine, tokenizer):
    zebra = _id(tokenizer, " zebra")
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                  logit_bias={str(zebra): 100})
    assert r.choices[0].text == " zebra zebra" != plain.choices[0].text
    # returned logprobs are the model's own, before the bias: the forced token reports how unlikely it was
    ids = tokenizer.encode(PROMPT)
    ref = engine.generate(input_ids=ids + [zebra], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=len(ids))["meta_info"]["input_token_logprobs"][-1][0]
    assert r.choices[0].logprobs.token_logprobs[0] == pytest.approx(ref, abs=1e-3) and ref < -5
    first = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text, add_special_tokens=False)[0] != first
    msgs = [{"role": "user", "content": "Name an animal."}]
    chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=3, temperature=0,
                                          logit_bias={str(zebra): 100})
    assert chat.choices[0].message.content == " zebra zebra zebra"
    streamed = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0, stream=True,
                                         logit_bias={str(zebra): 100})
    assert "".join(c.choices[0].text for c in streamed) == " zebra zebra"


def test_server_refuses_bad_logit_bias_with_400(client, server):
    for bias, msg in (({"10000000": 1}, "outside the model's vocabulary"), ({"5": 101}, r"\[-100, 100\]"),
                      ({"five": 1}, "not a token id")):
        for call in (lambda: client.completions.create(model="m", prompt="x", max_tokens=1, logit_bias=bias),
                     lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                            max_tokens=1, logit_bias=bias)):
            with pytest.raises(openai.BadRequestError, match="logit_bias.*" + msg):
                call()


def test_native_generate_takes_logit_bias(server, tokenizer):
    from urllib.request import Request, urlopen

    zebra = _id(tokenizer, " zebra")
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "logit_bias": {str(zebra): 100}}}
    req = Request(server.url + "/generate", data=json.dumps(body).encode(),
                  headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urlopen(req, timeout=60) as r:
        assert json.loads(r.read())["output_ids"] == [zebra]


# ---- logit-bias stepping in lmc.OpenAI -------------------------------------------------------------------------
@lmc.function
def quiz(s):
    s += lmc.user("What is the capital of France?")
    s += lmc.assistant(lmc.select("city", ["Paris", "London", "Berlin"]))
    s += lmc.user("How many legs does a spider have?")
    s += lmc.assistant(lmc.gen("legs", dtype=int, max_tokens=6))
    s += lmc.user("Is the sky blue? Answer True or False.")
    s += lmc.assistant(lmc.gen("sky", dtype=bool, max_tokens=4))
    s += lmc.user("A three letter word?")
    s += lmc.assistant(lmc.gen("word", regex="[a-z]{3}", max_tokens=5))


def test_stepping_gives_valid_values_and_counts_its_calls(server, tokenizer):
    for is_chat in (True, False):
        b = _backend(server, tokenizer, is_chat_model=is_chat)
        st = quiz.run(backend=b, temperature=0)
        assert st["city"] in ("Paris", "London", "Berlin") and st.get_meta_info("city")["method"] == "logit_bias"
        assert isinstance(st["legs"], int) and isinstance(st["sky"], bool)
        assert len(st["word"]) == 3 and st["word"].isalpha() and st["word"].islower()
        steps = [st.get_meta_info(k)["bias_calls"] for k in ("city", "legs", "sky", "word")]
        assert all(n >= 1 for n in steps)
        assert st.get_meta_info("word")["completion_tokens"] == steps[3] <= 3  # a full match needs no end call
        u = program_usage(st)
        assert u.bias_calls == sum(steps) and u.calls == u.bias_calls  # nothing else was called
        assert f"{u.bias_calls} logit-bias step call(s)" in u.summary()
        b.shutdown()


SELECTS = [("The capital of France is the city of ", ["London", "Paris", "Berlin"]),
           ("The largest planet in the solar system is ", ["Mars", "Jupiter", "Venus"]),
           ("Water freezes at zero degrees ", ["Kelvin", "Fahrenheit", "Celsius"]),
           ("Q: What color is the sky on a clear day?\nA: The sky is ", ["green", "blue", "red"])]


def test_select_follows_the_most_likely_first_token(server, engine, tokenizer, monkeypatch):
    """Choices that differ in their first character: one call decides, and at temperature 0 the decision is the
    choice begun by the most likely token among all tokens that begin a choice (the engine's full distribution)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    monkeypatch.setattr(engine, "max_top_logprobs", len(texts))  # the reference reads the whole distribution
    b = _backend(server, tokenizer, is_chat_model=False)
    refs = []
    for prompt, choices in SELECTS:
        top = engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True,
                              top_logprobs_num=len(texts))["meta_info"]["output_top_logprobs"][0]
        tid = next(t for _, t, _ in top if texts[t] and any(c.startswith(texts[t]) for c in choices))
        refs.append(next(c for c in choices if c.startswith(texts[tid])))
        st = _prog(prompt, lmc.select("x", choices)).run(backend=b, temperature=0)
        assert st["x"] == refs[-1], (prompt, texts[tid])
        assert st.get_meta_info("x")["bias_calls"] == 1 and program_usage(st).calls == 1
    assert len({c.index(r) for (_, c), r in zip(SELECTS, refs)}) > 1  # the cases do not all pick one position
    b.shutdown()


def test_auto_falls_back_to_stepping_where_nothing_else_fits(server, tokenizer):
    """A completion endpoint that returns no prompt logprobs (SGLang's) and is not a chat model: auto select is
    logit-bias stepping; forced, the other lowerings say why they cannot run."""
    prompt, choices = SELECTS[0]
    b = lmc.OpenAI("m", base_url=server.url + "/v1", api_key=KEY, server="sglang", is_chat_model=False,
                   tokenizer=tokenizer)
    prog = _prog(prompt, lmc.select("x", choices))
    st = prog.run(backend=b, temperature=0)
    assert st["x"] in choices and st.get_meta_info("x")["method"] == "logit_bias"
    for forced, msg in (("server", "prompt logprobs"), ("json_schema", "needs a chat model")):
        b.constraints = forced
        with pytest.raises(UnsupportedOnEndpoint, match=msg):
            prog.run(backend=b, temperature=0)
    b.shutdown()


def test_clear_errors_where_nothing_fits(server, tokenizer):
    prog = _prog("Pick: ", lmc.select("x", ["a", "b"]))
    no_tok = lmc.OpenAI("m", base_url=server.url + "/v1", api_key=KEY, server="sglang", is_chat_model=False)
    with pytest.raises(UnsupportedOnEndpoint, match=r"select needs logit-bias stepping here \(the endpoint offers "
                                                    r"no .*echo.*tokenizer=\.\.\."):
        prog.run(backend=no_tok)
    with pytest.raises(UnsupportedOnEndpoint, match="constraints='logit_bias'.*loading '/nonexistent' failed"):
        prog.run(backend=_backend(server, "/nonexistent", is_chat_model=False))
    b = _backend(server, tokenizer, is_chat_model=False)
    with pytest.raises(UnsupportedOnEndpoint, match="JSON schema cannot be lowered to logit-bias stepping"):
        _prog("x", lmc.gen("j", json_schema={"type": "object"})).run(backend=b)
    # a chat API that cannot continue a partial assistant message: stepping stops after its first token (digits
    # are single tokens in this vocabulary, so three of them need three steps)
    compat = _backend(server, tokenizer, server="compatible")
    with pytest.raises(UnsupportedOnEndpoint, match="wrote '[0-9]' and must go on.*cannot continue a partial"):
        _prog(lmc.user("A number?"), lmc.assistant(lmc.gen("n", regex="[0-9]{3}"))).run(backend=compat,
                                                                                         temperature=0)
    # the official API (no request is sent): no regex on a chat model, no JSON schema on a completion model
    official = lmc.OpenAI("gpt-4o-mini", api_key="sk-none")
    with pytest.raises(UnsupportedOnEndpoint, match="regex .*logit-bias stepping"):
        official._lowering(GenParams(regex="[a-z]+"), "chat")
    assert official._lowering(GenParams(dtype=int), "completions") == "logit_bias"
    with pytest.raises(UnsupportedOnEndpoint, match="JSON schema on a completion model"):
        official._lowering(GenParams(json_schema=json.dumps({"type": "object"})), "completions")
    with pytest.raises(ValueError, match="constraints must be one of"):
        lmc.OpenAI("m", api_key="x", constraints="grammar")
    for x in (no_tok, b, compat):
        x.shutdown()


def test_bias_maps_stay_within_the_api_limit(tokenizer):
    vocab = Vocabulary(tokenizer, end_ids=[2])
    st = Stepper(vocab, "[a-z]+ ?")
    bias = st.bias()
    assert len(bias) == MAX_BIAS_TOKENS and all(v == 100 for v in bias.values())
    texts = {tokenizer.decode([int(i)]) for i in bias}
    assert set("abcdefghijklmnopqrstuvwxyz") <= texts  # the shortest tokens are kept: any word can be spelled
    assert st.feed("do") is False and st.value == "do"
    bias = st.bias()  # a full match: the end ids come first, whitespace the pattern cannot take ends the value
    assert "2" in bias and _id(tokenizer, "\n") in map(int, bias)
    assert st.feed("\n") is True and st.result == "do"
    with pytest.raises(ValueError, match="did not honour logit_bias"):
        Stepper(vocab, "[a-z]+").feed("42")
