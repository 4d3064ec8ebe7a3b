"""Grammar-constrained decoding (regex / json_schema / ebnf through xgrammar) on the embedded model."""
import json
import re

import jsonschema
import pytest

from lmc.runtime import RequestError

SEEDS = (0, 1, 2)


def chat(q: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def sampled(engine, prompt, grammar: dict, max_new_tokens: int, **extra):
    """One batch: the same prompt at temperature 1.0 with a few seeds."""
    params = [{"max_new_tokens": max_new_tokens, "temperature": 1.0, "seed": s, **grammar, **extra} for s in SEEDS]
    return engine.generate([prompt] * len(SEEDS), params)


@pytest.mark.parametrize("question,regex", [
    ("Give me a phone number.", r"[0-9]{3}-[0-9]{4}"),
    ("Give me an email address.", r"[a-z0-9._]{1,12}@[a-z0-9]{1,10}\.(com|org|net)"),
    ("Is the sky blue?", r"(yes|no)"),
])
def test_regex_outputs_fullmatch(engine, question, regex):
    for r in sampled(engine, chat(question), {"regex": regex}, 30):
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}, r
        assert re.fullmatch(regex, r["text"]), r["text"]
        assert r["output_ids"][-1] == 2  # the grammar ended on EOS


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 2},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}


def test_json_schema_samples_validate(engine):
    outs = sampled(engine, chat("Describe a person as JSON."), {"json_schema": PERSON}, 90)
    for r in outs:
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}, r
        jsonschema.validate(json.loads(r["text"]), PERSON)
    assert len({r["text"] for r in outs}) > 1, "different seeds should sample different objects"
    compiles = engine.grammars.compiles  # the schema as JSON text is the same grammar: no new compilation
    req = engine.make_request("x", {"json_schema": json.dumps(PERSON)})
    assert req.grammar is not None and engine.grammars.compiles == compiles


def test_greedy_json_capital(engine):
    schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
              "required": ["country", "capital"]}
    r = engine.generate(chat("What is the capital of France? Answer in JSON."),
                        {"max_new_tokens": 40, "temperature": 0, "json_schema": schema})
    obj = json.loads(r["text"])
    jsonschema.validate(obj, schema)
    assert "Paris" in obj["capital"]


def test_ebnf(engine):
    ebnf = ('root ::= "SELECT " cols " FROM " table ";"\n'
            'cols ::= col | col ", " cols\n'
            'col ::= "id" | "name" | "age" | "email"\n'
            'table ::= "users" | "orders"')
    pattern = r"SELECT (id|name|age|email)(, (id|name|age|email))* FROM (users|orders);"
    for r in sampled(engine, chat("Write a SQL query."), {"ebnf": ebnf}, 40):
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r
        assert re.fullmatch(pattern, r["text"]), r["text"]


def test_mixed_batch_and_raw_logprobs(engine):
    free = {"max_new_tokens": 12, "temperature": 0}
    q = chat("Is the sky blue?")
    alone = engine.generate(q, free, return_logprob=True, top_logprobs_num=3)
    out = engine.generate([q, q, "The capital of France is", q],
                          [{**free, "regex": "(yes|no)"}, free, free, {**free, "regex": "[0-9]{2}"}],
                          return_logprob=True, top_logprobs_num=3)
    assert out[1]["output_ids"] == alone["output_ids"]
    assert re.fullmatch("(yes|no)", out[0]["text"]) and re.fullmatch("[0-9]{2}", out[3]["text"])
    assert out[2]["output_ids"] == engine.generate("The capital of France is", free)["output_ids"]
    # Logprobs are those of the raw distribution: the first position's top tokens do not depend on the mask.
    a_top, c_top = alone["meta_info"]["output_top_logprobs"][0], out[0]["meta_info"]["output_top_logprobs"][0]
    assert [t[1] for t in a_top] == [t[1] for t in c_top]
    assert [t[0] for t in a_top] == pytest.approx([t[0] for t in c_top], abs=1e-4)


def test_min_new_tokens_with_grammar(engine):
    q = chat("Give me a number.")
    # The grammar can end after one word: min_new_tokens cannot force tokens the grammar forbids, EOS ends it.
    r = engine.generate(q, {"max_new_tokens": 10, "temperature": 0, "regex": "(yes|no)", "min_new_tokens": 5})
    assert re.fullmatch("(yes|no)", r["text"]) and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    # An open-ended grammar: EOS stays banned until min_new_tokens, so at least that many digits come out.
    r = engine.generate(q, {"max_new_tokens": 12, "temperature": 0, "regex": "[0-9]+", "min_new_tokens": 6})
    assert re.fullmatch("[0-9]+", r["text"]) and len(r["output_ids"]) >= 6
    assert 2 not in r["output_ids"][:6]


@pytest.mark.parametrize("params,needle", [
    ({"regex": "[a-"}, r"invalid regex '\[a-'.*Unclosed"),
    ({"json_schema": {"type": "nonsense"}}, "invalid json_schema.*nonsense"),
    ({"json_schema": "{not json"}, "invalid json_schema.*Failed to parse JSON"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum greater than maximum"),
    ({"ebnf": 'root ::= foo'}, 'invalid ebnf.*Rule "foo" is not defined'),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one of regex, json_schema, ebnf.*regex, ebnf"),
    ({"regex": 5}, "regex"),
])
def test_bad_grammar_is_a_request_error(engine, params, needle):
    with pytest.raises(RequestError, match=needle):
        engine.generate("hi", {"max_new_tokens": 4, **params})
    out = engine.generate(["hi", "hi"], [{"max_new_tokens": 4, **params}, {"max_new_tokens": 4, "temperature": 0}])
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort" and out[0]["error"]
    assert len(out[1]["output_ids"]) == 4  # the engine keeps serving


def test_identical_grammars_compile_once(engine):
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,2}"
    before, compiles = len(engine.grammars.compiled), engine.grammars.compiles
    outs = engine.generate([chat("Name and day?")] * 8,
                           [{"max_new_tokens": 12, "temperature": 1.0, "seed": s, "regex": regex} for s in range(8)])
    assert len(engine.grammars.compiled) == before + 1 and engine.grammars.compiles == compiles + 1
    assert ("regex", regex) in engine.grammars.compiled
    for r in outs:  # each request had its own matcher
        assert r["meta_info"]["finish_reason"]["type"] == "stop" and re.fullmatch(regex, r["text"]), r


def test_grammar_needs_a_tokenizer():
    from lmc.runtime import Engine

    with Engine("dummy:tiny") as eng:
        with pytest.raises(RequestError, match="tokenizer"):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"regex": "a+", "max_new_tokens": 2})
        assert len(eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2
