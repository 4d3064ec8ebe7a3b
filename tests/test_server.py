"""`lmc serve` for real: the app on a loopback port (uvicorn in a thread) over the session engine, driven by the
`openai` client and raw HTTP. One server for the module."""
import asyncio
import json
import re
import time

import jsonschema
import openai
import pytest

from lmc.server import ServerThread, create_app

from conftest import API_KEY as KEY
from doubles import SlowCompilerDouble
from hostile_requests import HOSTILE

try:
    import httpx
except ImportError:  # installs that ship httpx under the name httpx2
    import httpx2 as httpx

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def _wait_idle(http, timeout=60.0) -> dict:
    """Wait until nothing is queued or running, then return the slot accounting."""
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/get_server_info").json()
        state = info["internal_states"][0]
        if state["waiting"] == 0 and state["running"] == 0 and info["in_flight_requests"] == 0:
            return info["slots"]
        assert time.monotonic() < deadline, f"the engine did not go idle: {state}"
        time.sleep(0.05)


def _assert_no_leak(http) -> None:
    slots = _wait_idle(http)
    assert slots["consistent"], slots
    assert slots["free_slots"] + slots["cached_slots"] + slots["request_owned_slots"] == slots["total_slots"]
    assert slots["request_owned_slots"] == 0 and slots["resident_requests"] == 0 and slots["protected_slots"] == 0


def test_chat_completion_matches_the_engine(client, engine, tokenizer):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of Italy?"}]
    r = client.chat.completions.create(model="any", messages=msgs, max_tokens=12, **GREEDY)
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ref = engine.generate(text, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [2]})
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref["text"] and ref["text"]
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(tokenizer.encode(text))
    assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_completions_n_stop_seed_and_models(client, tokenizer):
    prompt = "Q: Name a fruit.\nA:"
    kw = dict(model="any", prompt=prompt, max_tokens=10, temperature=0.9, n=3, seed=7, stop=["\n"])
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert all("\n" not in c.text for c in a.choices)
    assert a.usage.prompt_tokens == len(tokenizer.encode(prompt))  # billed once for n choices, as OpenAI does
    assert a.usage.completion_tokens > 0
    r = client.completions.create(model="any", prompt="Count: 1, 2, 3, 4,", max_tokens=20, stop=" 7", **GREEDY)
    assert r.choices[0].text.strip() == "5, 6," and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="any", prompt=["One,", "Two,"], max_tokens=3, **GREEDY)
    assert len(r.choices) == 2 and r.choices[1].index == 1
    models = client.models.list()
    assert models.data[0].id == "smollm2-135m-instruct" and models.data[0].owned_by == "lmc"


def test_streaming_equals_non_streaming(client):
    msgs = [{"role": "user", "content": "Count from one to five in words."}]
    full = client.chat.completions.create(model="m", messages=msgs, max_tokens=16, **GREEDY)
    chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    ref = client.completions.create(model="m", prompt="The sky is", max_tokens=8, **GREEDY).choices[0].text
    parts = list(client.completions.create(model="m", prompt="The sky is", max_tokens=8, stream=True, **GREEDY))
    assert "".join(p.choices[0].text for p in parts) == ref


def test_streaming_n_and_stop(client):
    chunks = list(client.completions.create(model="m", prompt="List: a, b, c,", max_tokens=12, n=2, stop=[" f"],
                                            stream=True, temperature=0))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    ref = client.completions.create(model="m", prompt="List: a, b, c,", max_tokens=12, stop=[" f"], temperature=0)
    assert texts[0] == texts[1] == ref.choices[0].text and " f" not in texts[0]


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(r.choices[0].message.content[:3])
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely one
    r = client.completions.create(model="m", prompt="One, two, three,", max_tokens=4, logprobs=2, echo=True,
                                  **GREEDY)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("One, two, three,")
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.text_offset[1] == len(lp.tokens[0])


def test_json_schema_response_format_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model="m", prompt="The answer is ", max_tokens=8, temperature=0.7, seed=1,
                                  extra_body={"regex": r"[0-9]{3}"})
    assert re.fullmatch(r"[0-9]{3}", r.choices[0].text)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Pick a color"}],
                                       max_tokens=8, extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
                                       **GREEDY)
    assert r.choices[0].message.content in ("red", "blue")


def test_usage_reports_cached_prompt_tokens(client):
    prefix = "Background: " + " ".join(f"fact {i} is that the number {i} follows {i - 1}." for i in range(40))
    first = client.completions.create(model="m", prompt=prefix + "\nQ: one?", max_tokens=2, **GREEDY)
    second = client.completions.create(model="m", prompt=prefix + "\nQ: two?", max_tokens=2, **GREEDY)
    shared = first.usage.prompt_tokens - 4
    assert second.usage.prompt_tokens_details.cached_tokens >= shared > 300


def test_api_key_is_enforced(server, client):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="hi", max_tokens=1)
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # open for load balancers
    assert httpx.get(server.url + "/get_server_info", headers={"x-api-key": KEY}).status_code == 200


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", b'{"prompt": "hi", ', "malformed JSON"),
    ("/v1/completions", b'[1, 2]', "JSON object"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n must be"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6}, "context length"),
    ("/v1/completions", {"prompt": "hi", "regex": "[a-", "max_tokens": 4}, ""),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "text-only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, "schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "regex": "a", "ebnf": "root ::= \"a\""},
     "at most one"),
    ("/generate", {"text": "hi", "input_ids": [1, 2]}, "exactly one"),
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 0}}, "temprature"),
    ("/generate", {"input_ids": [10 ** 9]}, "input_ids"),
    ("/generate", {"text": "hi", "image_data": "x.png"}, "text-only"),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(http, path, body, needle):
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    msg = r.json()["error"]["message"]
    assert needle.lower() in msg.lower(), msg
    ok = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_oversized_prompt_is_a_400(http, engine, tokenizer):
    long_text = "word " * (engine.context_length + 10)
    r = http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = http.post("/generate", json={"text": long_text, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_native_generate(http, tokenizer):
    single = http.post("/generate", json={"text": "The capital of France is",
                                          "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert single["text"] and len(single["output_ids"]) == single["meta_info"]["completion_tokens"] == 6
    ids = tokenizer.encode("The capital of France is")
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6,
                                                                                "temperature": 0}}).json()
    assert by_ids["output_ids"] == single["output_ids"]
    batch = http.post("/generate", json={"text": ["The capital of France is", "One, two,"],
                                         "sampling_params": [{"max_new_tokens": 6, "temperature": 0},
                                                             {"max_new_tokens": 2, "temperature": 0}]}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == single["output_ids"]
    assert batch[1]["meta_info"]["completion_tokens"] == 2
    # prefill only, prompt logprobs from a start position, token texts (what RuntimeEndpoint.select sends)
    r = http.post("/generate", json={"text": ["One two three four", "One two three five"],
                                     "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                     "return_logprob": True, "logprob_start_len": 2,
                                     "return_text_in_logprobs": True}).json()
    n = len(tokenizer.encode("One two three four"))
    for item in r:
        m = item["meta_info"]
        assert item["output_ids"] == [] and m["finish_reason"] == {"type": "length", "length": 0}
        assert len(m["input_token_logprobs"]) == n - 2 and all(lp < 0 for lp, _, _ in m["input_token_logprobs"])
    assert r[0]["meta_info"]["input_token_logprobs"][-1][2] == " four"
    # token_ids_logprob: one id list for all prompts, or one per prompt
    four, five = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" four", " five"))
    for ids_field in ([four, five], [[four, five], [five]]):
        r = http.post("/generate", json={"text": ["One two three", "One two"], "token_ids_logprob": ids_field,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                         "return_logprob": True}).json()
        for item, want in zip(r, ids_field if isinstance(ids_field[0], list) else [ids_field] * 2):
            [row] = item["meta_info"]["output_token_ids_logprobs"]
            assert [t for _, t, _ in row] == want and all(lp < 0 for lp, _, _ in row)
    # n in sampling_params, SGLang's sampling_seed, and SGLang keys at their default values
    r = http.post("/generate", json={"text": "Pick a number:", "sampling_params": {
        "max_new_tokens": 3, "n": 2, "temperature": 0.8, "sampling_seed": 3, "skip_special_tokens": True,
        "stop_regex": [], "top_k": -1}}).json()
    assert len(r) == 2


def test_sglang_frontend_requests_are_served(http, tokenizer):
    """The bodies SGLang's RuntimeEndpoint sends (notes/sglang_frontend.md 5.2, 5.4), verbatim."""
    gen = {"text": "Q: hi\nA:", "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16, "min_new_tokens": 0,
        "n": 1, "stop": ["\n", "<|eot_id|>"], "stop_token_ids": [], "stop_regex": [], "temperature": 0,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "ignore_eos": False, "regex": None, "json_schema": None}, "return_logprob": True, "top_logprobs_num": 2}
    r = http.post("/generate", json=gen)
    assert r.status_code == 200, r.text
    m = r.json()["meta_info"]
    assert len(m["output_token_logprobs"]) == m["completion_tokens"] and len(m["output_top_logprobs"][0]) == 2
    commit = http.post("/generate", json={"text": "Q: hi\nA:", "sampling_params": {"max_new_tokens": 0}})
    assert commit.status_code == 200
    prompt_len = len(tokenizer.encode("Q: hi\nA:"))
    sel = http.post("/generate", json={"text": ["Q: hi\nA: yes", "Q: hi\nA: no"],
                                       "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                       "return_logprob": True, "return_text_in_logprobs": True,
                                       "logprob_start_len": max(prompt_len - 2, 0)}).json()
    assert all(x["meta_info"]["input_token_logprobs"][-1][2] in (" yes", " no") for x in sel)
    assert http.get("/get_model_info").json()["model_path"]
    assert http.post("/flush_cache").status_code in (200, 400)


def test_native_streaming_is_cumulative(http):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "stream": True}
    events = []
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    texts = [d["text"] for d in data]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    ref = http.post("/generate", json={**body, "stream": False}).json()
    assert texts[-1] == ref["text"] and data[-1]["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert all(d["meta_info"]["finish_reason"] is None for d in data[:-1])
    assert all("index" not in d for d in data)  # SGLang marks events with an index only in a batch


def _sse_events(http, body) -> list[dict]:
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("body", [
    {"text": ["The capital of France is", "One, two,"],
     "sampling_params": [{"max_new_tokens": 6, "temperature": 0}, {"max_new_tokens": 3, "temperature": 0}]},
    {"input_ids": [[1, 504, 3575, 282], [1, 11, 2]], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
     "return_logprob": True},
    {"text": "Pick a number:", "sampling_params": {"max_new_tokens": 4, "n": 2, "temperature": 0.8,
                                                    "sampling_seed": 3}},
], ids=["texts", "input_ids", "n"])
def test_native_batch_streaming(http, body):
    """A batch (several prompts, or n > 1) streams SGLang's way: every event is one request's output so far, marked
    with that request's position in the batch; each request ends with its full result, equal to the non-streamed
    batch's."""
    events = _sse_events(http, {**body, "stream": True})
    ref = http.post("/generate", json=body).json()
    assert sorted({e["index"] for e in events}) == list(range(len(ref)))
    for i, want in enumerate(ref):
        mine = [e for e in events if e["index"] == i]
        texts = [e["text"] for e in mine]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert all(e["meta_info"]["finish_reason"] is None for e in mine[:-1])
        last = mine[-1]
        assert (last["text"], last["output_ids"]) == (want["text"], want["output_ids"]) and want["output_ids"]
        assert last["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        assert ("output_token_logprobs" in last["meta_info"]) == bool(body.get("return_logprob"))


def test_info_flush_health_metrics(http, server):
    info = http.get("/get_model_info").json()
    assert info["model_path"] == "smollm2-135m-instruct" and info["is_generation"] is True
    assert info["chat_template_roles"]["prefix"]["user"] == "<|im_start|>user\n"
    assert "{% for message in messages %}" in info["chat_template"]
    assert http.get("/model_info").json() == info
    tok = http.post("/tokenize", json={"prompt": ["yes", "no"], "add_special_tokens": False}).json()
    assert len(tok["tokens"]) == 2 and all(tok["tokens"])
    assert http.get("/health_generate").status_code == 200
    assert http.post("/flush_cache").status_code == 200
    slots = _wait_idle(http)
    assert slots["cached_slots"] == 0 and slots["free_slots"] == slots["total_slots"]
    http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0})
    http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "stream": True,
                                       "regex": "[a-z ]+"})
    text = http.get("/metrics").text
    for name in ("lmc:num_running_reqs", "lmc:num_queue_reqs", "lmc:token_usage", "lmc:cache_hit_rate",
                 "lmc:gen_throughput", "lmc:prompt_tokens_total", "lmc:cached_tokens_total",
                 "lmc:time_to_first_token_seconds_bucket", "lmc:e2e_request_latency_seconds_count",
                 "lmc:jump_forward_tokens_total", "lmc:num_so_requests_total"):
        assert re.search(rf"^{re.escape(name)}{{", text, re.M), name
    assert float(re.search(r"^lmc:time_to_first_token_seconds_count\{.*\} (\S+)", text, re.M).group(1)) >= 1
    assert float(re.search(r"^lmc:cached_tokens_total\{.*\} (\S+)", text, re.M).group(1)) > 0


def test_many_concurrent_requests_complete_without_leaks(server, http):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(i):
        if i % 2:
            r = await aclient.completions.create(model="m", prompt=f"Item {i}: the number after {i} is",
                                                 max_tokens=4, temperature=0)
            return r.choices[0].text
        r = await aclient.chat.completions.create(model="m", messages=[{"role": "user", "content": f"Say {i}"}],
                                                  max_tokens=4, temperature=0)
        return r.choices[0].message.content

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await aclient.close()

    outs = asyncio.run(main())
    assert len(outs) == 200 and all(isinstance(o, str) for o in outs)
    _assert_no_leak(http)


def _engine_stats(http) -> dict:
    return http.get("/get_server_info").json()["internal_states"][0]


def _assert_aborted(http, before: dict, n: int) -> None:
    """n requests were aborted since `before`, after far fewer decode steps than the 2000 they asked for (a GPU
    decodes a few hundred in the second a waiting client gives up after)."""
    _wait_idle(http)
    after = _engine_stats(http)
    assert after["aborted"] == before["aborted"] + n
    assert after["decode_forwards"] - before["decode_forwards"] < 1000


def test_client_disconnect_aborts_its_requests(server, http):
    """A client that hangs up mid-stream, or before its non-streamed response, has its requests aborted: decoding
    stops (each asked for 2000 tokens, ignoring EOS) and no KV slot stays owned."""
    prompt = "Write a long story about a dragon."
    openai_long = {"max_tokens": 2000, "min_tokens": 2000, "ignore_eos": True, "temperature": 0}
    native_long = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}
    streamed = [("/v1/completions", {"prompt": prompt, "stream": True, **openai_long}, 1),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "stream": True, "n": 2,
                                          **openai_long}, 2),
                ("/generate", {"text": prompt, "stream": True, "sampling_params": native_long}, 1),
                ("/generate", {"text": [prompt, "Once upon a time"], "stream": True,
                               "sampling_params": native_long}, 2)]
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body, n in streamed:
        before = _engine_stats(http)
        with httpx.Client(base_url=server.url, headers=auth, timeout=60) as c:
            with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                got = 0
                for line in r.iter_lines():
                    got += line.startswith("data:")
                    if got >= 3:
                        break  # hang up mid-stream
        _assert_aborted(http, before, n)
    waited = [("/v1/completions", {"prompt": prompt, **openai_long}, 1),
              ("/generate", {"text": [prompt, "Once upon a time"], "sampling_params": native_long}, 2)]
    for path, body, n in waited:
        before = _engine_stats(http)
        with httpx.Client(base_url=server.url, headers=auth, timeout=httpx.Timeout(60, read=1.0)) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post(path, json=body)  # gives up waiting and closes the connection
        _assert_aborted(http, before, n)
    _assert_no_leak(http)
    ok = http.post("/v1/completions", json={"prompt": "Still there?", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_overloaded_server_answers_503(engine):
    with ServerThread(create_app(engine, max_pending=2)) as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json={
                    "prompt": f"Number {i}", "max_tokens": 8, "temperature": 0}) for i in range(8)))

        codes = sorted(r.status_code for r in asyncio.run(main()))
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
        assert httpx.get(srv.url + "/health").status_code == 200


# ---- reliability: hostile bodies, security defaults, bounds ------------------------------------------------------
@pytest.mark.parametrize("path,body,needle", HOSTILE, ids=[f"{i}-{p}" for i, (p, _, _) in enumerate(HOSTILE)])
def test_hostile_requests_get_4xx_naming_the_problem(http, path, body, needle):
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text[:500]
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() or needle == err["param"], err


def test_hostile_requests_leave_the_others_and_the_cache_standing(server, http):
    """The issue's scenario: ordinary requests decoding while the hostile ones arrive all get their full answer,
    and the warm prefix stays cached."""
    warm = "A warm prefix shared by the ordinary requests: " + "the quick brown fox jumps. " * 30
    ref = http.post("/generate", json={"text": warm + "Go", "sampling_params": {"max_new_tokens": 12,
                                                                               "temperature": 0}}).json()

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as c:
            normal = [c.post("/generate", json={"text": warm + "Go", "sampling_params": {
                "max_new_tokens": 12, "temperature": 0}}) for _ in range(8)]
            hostile = [c.post(p, content=b) if isinstance(b, bytes) else c.post(p, json=b) for p, b, _ in HOSTILE]
            return await asyncio.gather(*normal), await asyncio.gather(*hostile)

    normal, hostile = asyncio.run(main())
    assert all(r.status_code == 200 and r.json()["output_ids"] == ref["output_ids"] for r in normal)
    assert all(400 <= r.status_code < 500 for r in hostile), [r.status_code for r in hostile]
    again = http.post("/generate", json={"text": warm + "Go", "sampling_params": {"max_new_tokens": 1}}).json()
    assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 2
    _assert_no_leak(http)


def test_every_route_but_health_needs_the_key(server, engine):
    routes = [("GET", "/metrics"), ("GET", "/get_server_info"), ("GET", "/server_info"), ("GET", "/get_model_info"),
              ("GET", "/v1/models"), ("GET", "/health_generate"), ("POST", "/flush_cache"), ("POST", "/generate"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]},
                        {"Authorization": "Bearer " + KEY + "x"}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (method, path, headers)
    assert httpx.get(server.url + "/health").status_code == 200
    # a non-ASCII key is compared as bytes (hmac.compare_digest would raise on non-ASCII str)
    r = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer ключ".encode()})
    assert r.status_code == 401
    with ServerThread(create_app(engine, api_key=KEY, enable_metrics=True, metrics_no_auth=True)) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200  # opened for a scraper
        assert httpx.get(srv.url + "/get_server_info").status_code == 401


def test_state_changing_routes_are_post_only(http):
    r = http.get("/flush_cache")
    assert r.status_code == 405, r.text
    _wait_idle(http)
    assert http.post("/flush_cache").status_code == 200


def test_request_body_is_bounded(engine):
    with ServerThread(create_app(engine, max_body_bytes=10_000)) as srv:
        body = {"text": "x" * 20_000, "sampling_params": {"max_new_tokens": 1}}
        r = httpx.post(srv.url + "/generate", json=body)
        assert r.status_code == 413 and "10000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(20):
                yield b" " * 1000

        r = httpx.post(srv.url + "/generate", content=chunks())
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
        ok = httpx.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
        assert ok.status_code == 200


class _GrammarLimits:
    """Set the session engine's grammar-cache limits for one test, and restore them after."""

    def __init__(self, engine, **limits):
        self.cache, self.limits = engine.grammars, limits

    def __enter__(self):
        self.saved = {k: getattr(self.cache, k) for k in self.limits}
        self.cache.configure(**self.limits)
        return self.cache

    def __exit__(self, *exc):
        self.cache.configure(**self.saved)


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^lmc:{name}\{{.*\}} (\S+)", text, re.M).group(1))


def test_distinct_regexes_are_evicted_and_counted(http, engine):
    with _GrammarLimits(engine, max_entries=4):
        before = _metric(http.get("/metrics").text, "grammar_cache_evictions_total")
        for i in range(10):
            r = http.post("/generate", json={"text": "Code:", "sampling_params": {
                "max_new_tokens": 3, "temperature": 0, "regex": f"[0-9]{{3}}-{i}x"}})
            assert r.status_code == 200 and re.fullmatch(r"[0-9]{1,3}", r.json()["text"]), r.text
        text = http.get("/metrics").text
        assert _metric(text, "grammar_cache_entries") <= 4 == len(engine.grammars.compiled)
        assert _metric(text, "grammar_cache_evictions_total") >= before + 6
        assert _metric(text, "grammar_compiles_total") >= 10


def _slow_regex(n: int) -> str:
    return "[a-z ]{1,%d}" % n  # a real compile (0.5 s to seconds by xgrammar build and CPU), which the double slows


def test_grammar_compile_timeout_is_a_400_naming_the_constraint(http, engine):
    with _GrammarLimits(engine, compile_timeout=0.2), SlowCompilerDouble.installed(engine.grammars, _slow_regex(3001)):
        t0 = time.monotonic()
        r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2,
                                                                         "regex": _slow_regex(3001)}})
        assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
        assert "did not compile within 0.2 s" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5
    assert _metric(http.get("/metrics").text, "grammar_compile_timeouts_total") >= 1


def test_grammar_compilation_does_not_block_the_event_loop(server, http, engine):
    """While a grammar compiles for seconds (and a long prompt is tokenized), /health keeps answering: its worst
    latency is a fraction of the compile's (on the event loop, it would wait the whole compile)."""
    slow_regex = _slow_regex(3002)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as c:
            t0 = time.perf_counter()
            slow = asyncio.ensure_future(c.post("/generate", json={"text": "Hi", "sampling_params": {
                "max_new_tokens": 1, "regex": slow_regex}}))
            long = asyncio.ensure_future(c.post("/tokenize", json={"prompt": "many words " * 20000}))
            await asyncio.sleep(0.2)
            worst = 0.0
            while not slow.done():
                t1 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                worst = max(worst, time.perf_counter() - t1)
                await asyncio.sleep(0.02)
            return worst, time.perf_counter() - t0, await slow, await long

    with SlowCompilerDouble.installed(engine.grammars, slow_regex):
        worst, took, slow, long = asyncio.run(main())
    assert slow.status_code == 200 and long.status_code == 200, (slow.text, long.text)
    assert took > 2.0 and worst < took / 3, (worst, took)


# ---- SGLang's worker API (what SGLang's clients send and read) ---------------------------------------------------
def test_sglang_fields_at_their_defaults_are_accepted_and_others_refused_by_name(http):
    bench = {"text": "Hello", "sampling_params": {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True},
             "stream": False, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
             "logprob_start_len": -1, "image_data": None, "bootstrap_room": None, "routing_key": "user-7",
             "custom_labels": {"team": "a"}, "priority": None}  # SGLang's serving benchmark client, and friends
    r = http.post("/generate", json=bench)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text
    for field, value in (("return_routed_experts", True), ("lora_path", "adapter"), ("priority", 3),
                         ("extra_key", "tenant"), ("bootstrap_room", 12), ("image_data", ["x.png"])):
        r = http.post("/generate", json={**bench, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert field in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "return_routed_experts": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
    r = http.post("/generate", json={**bench, "return_wishes": False})  # a field nobody defines stays a 400
    assert r.status_code == 400 and "unknown field 'return_wishes'" in r.json()["error"]["message"]


def test_cached_tokens_details_are_reported_when_asked(http):
    body = {"prompt": "A shared opening line for the cache report. " * 8 + "Go", "max_tokens": 1,
            "temperature": 0, "return_cached_tokens_details": True}
    http.post("/v1/completions", json=body)
    r = http.post("/v1/completions", json=body).json()
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and r["sglext"] == {"cached_tokens_details": {"device": cached, "host": 0}}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                "return_cached_tokens_details": False}).json()
    assert "sglext" not in r


def test_streamed_generate_events_carry_token_counts(http):
    prompt = "Counting upward: one, two, three,"
    http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}})  # warm the cache
    events = _sse_events(http, {"text": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert all("cached_tokens" in e["meta_info"] for e in events)
    assert counts == sorted(counts) and counts[-1] == 8 and counts[0] >= 1, counts
    assert events[0]["meta_info"]["cached_tokens"] == events[-1]["meta_info"]["cached_tokens"] > 0


def test_kept_alive_requests_do_not_wait_for_delayed_acks(server):
    """The server's connections have Nagle's algorithm off: without TCP_NODELAY a response written in two pieces
    (head, body) waits for the client's delayed ACK of the first, at least 40 ms per request on a kept-alive
    connection (what every call of an interpreted program paid)."""
    import socket

    sock = socket.create_connection((server.host, server.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the client's side sends each request in one write
    body = b'{"prompt": "hello"}'
    request = (f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    times = []
    with sock:
        for _ in range(12):
            t0 = time.perf_counter()
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
                data += sock.recv(65536)
            times.append(time.perf_counter() - t0)
    assert sorted(times)[len(times) // 2] < 0.03, times  # the median: a delayed ACK is 40 ms at the least


def _content_length(response: bytes) -> int:
    head = response.split(b"\r\n\r\n", 1)[0].decode().lower()
    return int(re.search(r"content-length: *(\d+)", head).group(1))
