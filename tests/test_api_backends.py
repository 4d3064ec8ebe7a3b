"""The API backends against a real `lmc serve` on loopback (one server for the module, on the session engine):
the same programs give the same results at temperature 0 on lmc.Local, lmc.RuntimeEndpoint and lmc.OpenAI (chat
and completion models); usage accounting; the retry policy; the response cache; constraint lowering; API
speculative execution."""
import json
import time

import jsonschema
import pytest

import lmc
from lmc.backend.openai import UnsupportedOnEndpoint, program_usage, split_chat, total_usage
from lmc.server import ServerThread

from conftest import API_KEY as KEY
from test_examples import load

extraction = load("extraction")



@pytest.fixture(scope="module")
def backends(engine, server):
    bs = {"local": lmc.Local(engine=engine),
          "endpoint": lmc.RuntimeEndpoint(server.url, api_key=KEY),
          "openai": lmc.OpenAI("smollm2", base_url=server.url + "/v1", api_key=KEY)}
    yield bs
    bs["endpoint"].shutdown()
    bs["openai"].shutdown()


@pytest.fixture(scope="module")
def completion_backend(server):
    b = lmc.OpenAI("smollm2", base_url=server.url + "/v1", api_key=KEY, is_chat_model=False)
    yield b
    b.shutdown()


# ---- the program suite -------------------------------------------------------------------------------------------
@lmc.function
def chat_qa(s, question):
    s += lmc.system("You are a concise assistant.")
    s += lmc.user(question)
    s += lmc.assistant(lmc.gen("answer", max_tokens=12))


@lmc.function
def multi_turn_select(s):
    s += lmc.user("What is the capital of France?")
    s += lmc.assistant(lmc.select("city", ["Paris", "London", "Berlin"]))
    s += lmc.user("Why?")
    s += lmc.assistant(lmc.gen("why", max_tokens=10))


@lmc.function
def constrained(s):
    s += lmc.user("How many legs does a spider have?")
    s += lmc.assistant(lmc.gen("legs", dtype=int, max_tokens=6))
    s += lmc.user("Give a small JSON object describing a cat.")
    s += lmc.assistant(lmc.gen("cat", max_tokens=40, json_schema={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}))
    s += lmc.user("A three letter word?")
    s += lmc.assistant(lmc.gen("word", regex="[a-z]{3}", max_tokens=5))


@lmc.function
def forked(s):
    s += lmc.system("You answer in a few words.")
    s += lmc.user("Name a color.")
    f = s.fork(2)
    f += lmc.assistant(lmc.gen("color", max_tokens=6))
    f.join()
    s += lmc.user("And a fruit?")
    s += lmc.assistant(lmc.gen("fruit", max_tokens=6, n=2))


@lmc.function
def few_shot(s, country):
    s += "Q: What is the capital of Japan?\nA: Tokyo\nQ: What is the capital of Italy?\nA: Rome\n"
    s += "Q: What is the capital of " + country + "?\nA:" + lmc.gen("capital", max_tokens=8, stop="\n")
    s += "\nIs it a large city? " + lmc.select("large", ["yes", "no"])
    s += "\nA city of the same country: " + lmc.select("other", ["Lyon", "Madrid", "Osaka"])
    s += "\nSentiment of 'great': " + lmc.select("sent", ["positive", "negative"],
                                                  choices_method=lmc.unconditional_likelihood_normalized)


def _values(state) -> dict:
    return state.variables()


def _run(prog, backend, **kw):
    return _values(prog.run(backend=backend, temperature=0, **kw))


def test_same_results_on_local_endpoint_and_openai(backends, completion_backend):
    cases = [(chat_qa, {"question": "What is the capital of Spain?"}), (multi_turn_select, {}), (constrained, {}),
             (forked, {}), (few_shot, {"country": "France"})]
    got = {}
    for prog, kw in cases:
        ref = got[prog.__name__, "local"] = _run(prog, backends["local"], **kw)
        assert all(v not in ("", None) for v in ref.values()), (prog, ref)
        for name in ("endpoint", "openai"):
            b = completion_backend if (prog is few_shot and name == "openai") else backends[name]
            got[prog.__name__, name] = _run(prog, b, **kw)
            assert got[prog.__name__, name] == ref, (prog.__name__, name)
    for name in ("local", "endpoint", "openai"):
        c = got["constrained", name]
        jsonschema.validate(json.loads(c["cat"]), {"type": "object", "required": ["name", "age"]})
        assert isinstance(c["legs"], int) and len(c["word"]) == 3
        assert len(got["forked", name]["color"]) == 2 and len(got["forked", name]["fruit"]) == 2


def test_streaming_and_batch_agree_across_backends(backends, completion_backend):
    qs = [{"question": q} for q in ("What is 2+2?", "Name a planet.")]
    ref = [s.variables() for s in chat_qa.run_batch(qs, backend=backends["local"], temperature=0)]
    for b in (backends["endpoint"], backends["openai"]):
        assert [s.variables() for s in chat_qa.run_batch(qs, backend=b, temperature=0)] == ref
        st = chat_qa.run(question="What is 2+2?", backend=b, temperature=0, stream=True)
        assert "".join(st.text_iter("answer")) == ref[0]["answer"]
    st = few_shot.run(country="Germany", backend=completion_backend, temperature=0, stream=True)
    streamed = "".join(st.text_iter())
    assert streamed == few_shot.run(country="Germany", backend=backends["local"], temperature=0).text()


def test_usage_accounting_per_program_and_batch(backends):
    b = backends["openai"]
    before = lmc.Usage().add(b.usage)
    states = chat_qa.run_batch([{"question": f"What is {i} plus {i}?"} for i in range(4)], backend=b, temperature=0)
    per = [program_usage(s) for s in states]
    assert all(u.calls == 1 and u.prompt_tokens > 20 and u.completion_tokens > 0 for u in per)
    total = total_usage(states)
    assert total.calls == 4 and total.prompt_tokens == sum(u.prompt_tokens for u in per)
    delta = b.usage + lmc.Usage()
    for f in ("calls", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert getattr(delta, f) - getattr(before, f) == getattr(total, f)
    assert total.cached_tokens > 0  # the system prompt is shared: the server reports it cached
    st = forked.run(backend=b, temperature=0)  # forks add to their program's usage
    assert program_usage(st).calls == 4  # fork commit (prefill), two branches, one n=2 call
    st = forked.run(backend=backends["endpoint"], temperature=0)
    assert program_usage(st).calls == 4 and program_usage(st).prompt_tokens > 0


def test_chat_split_round_trips_the_template(backends):
    tmpl = backends["openai"].chat_template
    text = (tmpl.default_system + tmpl.prefix["user"] + "hi" + tmpl.suffix["user"] + tmpl.prefix["assistant"]
            + " yes" + tmpl.suffix["assistant"] + tmpl.prefix["user"] + "more" + tmpl.suffix["user"]
            + tmpl.prefix["assistant"] + "So")
    msgs, role, partial = split_chat(text, tmpl)
    assert msgs == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yes"},
                    {"role": "user", "content": "more"}] and role == "assistant" and partial == "So"


def test_chat_model_continues_a_partial_assistant_turn_on_lmc(backends):
    @lmc.function
    def partial(s):
        s += lmc.user("Spell the word cat.")
        s += lmc.assistant("The letters are:" + lmc.gen("letters", max_tokens=8))

    assert _run(partial, backends["openai"]) == _run(partial, backends["local"])


def test_lowering_for_the_official_api():
    b = lmc.OpenAI("gpt-4o-mini", api_key="sk-none")  # no network: nothing is sent in this test
    assert b.server == "openai" and b.is_chat_model
    from lmc.frontend.primitives import DEFAULT_PARAMS, GenParams

    kw, rf, unwrap = b._sampling(GenParams(dtype=int).merged_over(DEFAULT_PARAMS), "chat")
    assert rf["json_schema"]["schema"]["properties"]["value"]["type"] == "integer" and unwrap == "value"
    assert "max_completion_tokens" in kw and "extra_body" not in kw
    kw, rf, _ = b._sampling(GenParams(json_schema='{"type": "object"}').merged_over(DEFAULT_PARAMS), "chat")
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"] == {"type": "object"}
    with pytest.raises(UnsupportedOnEndpoint, match="regex"):
        b._sampling(GenParams(regex="[a-z]+").merged_over(DEFAULT_PARAMS), "chat")
    with pytest.raises(UnsupportedOnEndpoint, match="top_k"):
        b._sampling(GenParams(top_k=5).merged_over(DEFAULT_PARAMS), "chat")
    assert lmc.OpenAI("gpt-3.5-turbo-instruct", api_key="x").is_chat_model is False


def test_select_as_json_enum_on_a_chat_api(server, backends):
    """A chat endpoint without prompt logprobs: select is one call asking for an enum (response_format)."""
    b = lmc.OpenAI("m", base_url=server.url + "/v1", api_key=KEY, server="compatible")
    st = multi_turn_select.run(backend=b, temperature=0)
    assert st["city"] in ("Paris", "London", "Berlin") and st.get_meta_info("city")["method"] == "json_schema_enum"
    assert program_usage(st).calls == 2
    b.shutdown()


def _fake_api(fail_times: int, retry_after: str):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, calls = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        calls.append(time.monotonic())
        if len(calls) <= fail_times:
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429,
                                headers={"Retry-After": retry_after})
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
                          "prompt_tokens_details": {"cached_tokens": 3}}}

    return app, calls


def test_retry_honours_retry_after_and_cache(tmp_path, monkeypatch):
    app, calls = _fake_api(2, "0.4")
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path))
    with ServerThread(app) as srv:
        b = lmc.OpenAI("fake", base_url=srv.url + "/v1", api_key="k", cache=True)
        assert b.server == "compatible"
        st = chat_qa.run(question="hi", backend=b, temperature=0)
        assert st["answer"] == "ok" and len(calls) == 3
        assert calls[1] - calls[0] >= 0.38 and calls[2] - calls[1] >= 0.38  # waited what Retry-After said
        u = program_usage(st)
        assert (u.calls, u.retries, u.prompt_tokens, u.cached_tokens) == (1, 2, 7, 3)
        st = chat_qa.run(question="hi", backend=b, temperature=0)  # same request: from the response cache
        assert st["answer"] == "ok" and len(calls) == 3 and program_usage(st).cache_hits == 1
        assert list((tmp_path / "openai").glob("*.json"))
        b2 = lmc.OpenAI("fake", base_url=srv.url + "/v1", api_key="k", cache=True)  # a new process: disk
        assert chat_qa.run(question="hi", backend=b2, temperature=0)["answer"] == "ok" and len(calls) == 3
        chat_qa.run(question="hi", backend=b2, temperature=0.7)  # sampled: never cached by default
        assert len(calls) == 4
    with ServerThread(_fake_api(10, "0")[0]) as srv:
        b3 = lmc.OpenAI("fake", base_url=srv.url + "/v1", api_key="k", max_retries=1)
        with pytest.raises(ConnectionError, match="RateLimitError after 1 retries"):
            chat_qa.run(question="hi", backend=b3, temperature=0)


def test_errors_from_the_server_reach_the_program(backends, server):
    with pytest.raises(ValueError, match="API key"):
        lmc.OpenAI("m", base_url=server.url + "/v1", api_key="wrong")

    @lmc.function
    def bad(s):
        s += "x" + lmc.gen("y", max_tokens=4, top_p=0.0)

    for name in ("endpoint", "openai"):
        with pytest.raises(ValueError, match="top_p"):
            bad.run(backend=backends[name] if name == "endpoint" else
                    lmc.OpenAI("m", base_url=backends["endpoint"].base_url + "/v1", api_key=KEY,
                               is_chat_model=False))


# ---- API speculative execution -----------------------------------------------------------------------------------
DOCS = ["Marie Curie (7 November 1867 - 4 July 1934) was a Polish physicist and chemist who conducted pioneering "
        "research on radioactivity.",
        "Albert Einstein (14 March 1879 - 18 April 1955) was a German-born theoretical physicist who developed the "
        "theory of relativity.",
        "Ada Lovelace (10 December 1815 - 27 November 1852) was an English mathematician and writer, chiefly known "
        "for her work on the Analytical Engine.",
        "Louis Pasteur (27 December 1822 - 28 September 1895) was a French chemist and microbiologist renowned for "
        "his discoveries of vaccination."]


extract = lmc.function(extraction.completion_body)
extract_spec = extraction.extract  # num_api_spec_tokens=32


def test_speculation_one_call_instead_of_three(completion_backend, backends):
    args = [{"doc": DOCS[i % len(DOCS)]} for i in range(8)]
    plain = extract.run_batch(args, backend=completion_backend, temperature=0)
    spec = extract_spec.run_batch(args, backend=completion_backend, temperature=0)
    local = extract_spec.run_batch(args, backend=backends["local"], temperature=0)  # Local ignores speculation
    for a, p, s, loc in zip(args, plain, spec, local):
        assert s.variables() == p.variables() == loc.variables()  # no cross-talk: each its own document
        assert s["name"].strip() in a["doc"]
    up, us = total_usage(plain), total_usage(spec)
    assert (up.calls, us.calls, us.calls_saved) == (24, 8, 16)
    assert us.prompt_tokens <= 0.4 * up.prompt_tokens
    st = extract_spec.bind(doc=DOCS[0]).run(backend=completion_backend, temperature=0)  # bind keeps it
    assert program_usage(st).calls == 1


def test_speculation_falls_back_to_normal_calls_on_a_template_mismatch(completion_backend):
    def body(s):  # the model writes "Birthdate", not the template's "Birthday": values come from normal calls
        s += "Extract the name, birthday and job.\n\nText: Isaac Newton (25 December 1642) was an English " \
             "mathematician.\nName: Isaac Newton\nBirthday: 25 December 1642\nJob: mathematician\n\nText: " + \
             DOCS[0] + "\n"
        s += "Name:" + lmc.gen("name", max_tokens=16, stop="\n") + "\nBirthday:" + \
            lmc.gen("birthday", max_tokens=16, stop="\n") + "\nJob:" + lmc.gen("job", max_tokens=16, stop="\n")

    plain = lmc.function(body).run(backend=completion_backend, temperature=0)
    spec = lmc.function(body, num_api_spec_tokens=32).run(backend=completion_backend, temperature=0)
    assert spec.variables() == plain.variables() and all(v.strip() for v in spec.variables().values())
    u = program_usage(spec)
    assert u.calls <= 4 and u.calls_saved <= 1


def test_chat_speculation(backends):
    body = extraction.chat_body
    b = backends["openai"]
    for doc in DOCS[:1]:
        plain = lmc.function(body).run(doc=doc, backend=b, temperature=0)
        spec = lmc.function(body, num_api_spec_tokens=40).run(doc=doc, backend=b, temperature=0)
        assert spec.variables() == plain.variables()
        assert all(v.strip() for v in spec.variables().values())
        u = program_usage(spec)
        assert u.calls + u.calls_saved >= 3 and u.calls <= 4  # one speculative call; normal calls if mismatched


def test_template_from_a_jinja_chat_template(tokenizer):
    from lmc.backend.endpoint import template_from_model_info
    from lmc.frontend.chat_template import ChatTemplate

    got = template_from_model_info({"chat_template": tokenizer.chat_template})
    ref = ChatTemplate.from_tokenizer(tokenizer)
    assert (got.prefix, got.suffix, got.default_system) == (ref.prefix, ref.suffix, ref.default_system)


PROGRAM = """
import lmc

@lmc.function
def capital(s, country):
    s += "Q: What is the capital of Japan?\\nA: Tokyo\\nQ: What is the capital of " + country + "?\\nA:"
    s += lmc.gen("answer", max_tokens=6, stop="\\n")
"""


def test_cli_run_and_run_batch_on_api_backends(server, tmp_path):
    import subprocess
    import sys

    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    base = [sys.executable, "-m", "lmc.cli"]
    r = subprocess.run(base + ["run", str(prog), "--backend", "openai", "--completion-model", "--base-url",
                               server.url + "/v1", "--api-key", KEY, "--arg", "country=France", "--temperature", "0",
                               "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["variables"]["answer"].strip() == "Paris"
    assert "usage: 1 call(s)" in r.stderr and "call(s) saved by speculation" in r.stderr
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"country": "France"}\n{"country": "Italy"}\n')
    r = subprocess.run(base + ["run-batch", str(prog), "--backend", "endpoint", "--base-url", server.url,
                               "--api-key", KEY, "-i", str(inp), "-o", str(out), "--temperature", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["variables"]["answer"].strip() for x in recs] == ["Paris", "Rome"]
    assert all(x["usage"]["calls"] == 1 for x in recs) and "usage: 2 call(s)" in r.stderr
    r = subprocess.run(base + ["run", str(prog), "--backend", "endpoint", "--base-url", server.url,
                               "--arg", "country=France"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "API key" in r.stderr  # no key: refused before anything runs
