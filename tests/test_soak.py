"""Soak test: the real server (`lmc serve`'s app on loopback) under a few hundred requests from many threads,
mixing normal, streamed, aborted-mid-stream, hostile (tests/hostile_requests.py) and hypothesis-generated
malformed requests (wrong types, out-of-range numbers, huge lists, bad UTF-8, non-finite numbers, unknown fields,
truncated JSON). Afterwards: every normal request got the same full answer as alone at temperature 0, every
malformed one a 4xx with a message, no KV slot is left owned by a request, and the warm prefix is still cached.

benchmarks/soak_bench.py is the long version (minutes, thousands of requests, memory sampled)."""
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import API_KEY as KEY
from hostile_requests import HOSTILE

try:
    import httpx
except ImportError:  # installs that ship httpx under the name httpx2
    import httpx2 as httpx

WARM = ("You are a careful assistant. The following notes are shared by every ordinary request of this soak: "
        + " ".join(f"note {i} says that {i} squared is {i * i}." for i in range(30)) + "\n")
QUESTIONS = [f"Q: what is {i} plus {i + 3}?\nA:" for i in range(6)]
REGEXES = [rf"[0-9]{{{1 + i % 3}}}(, [a-z]{{2,{3 + i}}})?" for i in range(12)]  # a stream of distinct grammars
GREEDY = {"temperature": 0}
VOCAB = 49152


# ---- the normal requests and their answers alone ------------------------------------------------------------------
def _normal_requests() -> list[tuple[str, str, dict]]:
    """(kind, path, body): kinds stream or not; each body's answer alone is its reference."""
    out = []
    for q in QUESTIONS:
        out.append(("generate", "/generate", {"text": WARM + q, "sampling_params": {"max_new_tokens": 8, **GREEDY}}))
        out.append(("completion", "/v1/completions", {"prompt": WARM + q, "max_tokens": 8, **GREEDY}))
        out.append(("chat", "/v1/chat/completions", {"messages": [{"role": "system", "content": WARM},
                                                                  {"role": "user", "content": q}],
                                                     "max_tokens": 8, **GREEDY}))
    for i, rx in enumerate(REGEXES):
        out.append(("generate", "/generate", {"text": WARM + f"Item {i}:", "sampling_params": {
            "max_new_tokens": 10, "regex": rx, **GREEDY}}))
    return out


def _answer(kind: str, r) -> str | list:
    assert r.status_code == 200, r.text[:300]
    if kind == "generate":
        return r.json()["output_ids"]
    if kind == "completion":
        return r.json()["choices"][0]["text"]
    return r.json()["choices"][0]["message"]["content"]


def _streamed_answer(client, kind: str, path: str, body: dict) -> str | list:
    """The same answer, streamed: /generate's last event carries the output ids, the OpenAI routes' deltas add
    up to the text."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()[:300]
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]", events[-3:]
    data = [json.loads(e) for e in events[:-1]]
    assert not any("error" in d for d in data), data
    if kind == "generate":
        assert data[-1]["meta_info"]["finish_reason"] is not None
        return data[-1]["output_ids"]
    if kind == "completion":
        return "".join(d["choices"][0]["text"] for d in data)
    return "".join(d["choices"][0]["delta"].get("content") or "" for d in data if d["choices"])


def _abort_mid_stream(client, i: int) -> int:
    """A long stream the client hangs up on after two events. Returns the events read."""
    body = {"text": WARM + f"Tell story number {i}.", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, **GREEDY}}
    got = 0
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            got += line.startswith("data:")
            if got >= 2:
                break
    return got


# ---- malformed bodies, generated --------------------------------------------------------------------------------
_ints = st.integers(min_value=-(2 ** 80), max_value=2 ** 80)
_junk = st.one_of(st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=4, max_size=12)
_word = st.text(alphabet="xyz", min_size=1, max_size=4)  # never a number (pydantic would parse "12" as one)
_KNOWN = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
          "token_ids_logprob", "return_text_in_logprobs", "stream", "rid", "image_data", "modalities", "lora_path",
          "session_params", "custom_logit_processor", "return_hidden_states", "log_metrics", "prompt", "messages",
          "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "frequency_penalty", "presence_penalty",
          "logit_bias", "user", "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids",
          "skip_special_tokens", "regex", "ebnf", "json_schema", "structured_outputs", "echo", "logprobs", "best_of",
          "suffix", "response_format", "stream_options", "max_completion_tokens", "top_logprobs", "tools",
          "tool_choice", "parallel_tool_calls", "metadata", "store", "continue_final_message",
          "add_generation_prompt"}
_BASE = {"/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
         "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}}

# (field, values that are always invalid for it): set in the body (OpenAI routes) or in sampling_params (native)
_BAD_SAMPLING = {
    "temperature": st.one_of(st.floats(max_value=-1e-3, allow_nan=False, allow_infinity=False), _word,
                             st.lists(st.floats(allow_nan=False), min_size=1, max_size=2)),
    "top_p": st.one_of(st.floats(min_value=1.001, max_value=1e300), st.floats(max_value=0.0, allow_nan=False,
                                                                                 allow_infinity=False)),
    "seed": st.one_of(st.integers(min_value=2 ** 64), st.integers(max_value=-(2 ** 63) - 1), _word),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=VOCAB, max_value=2 ** 62), min_size=1, max_size=3),
                                st.lists(st.integers(0, 100), min_size=1025, max_size=1100), _word),
    "stop": st.one_of(st.lists(st.just("x"), min_size=65, max_size=400), st.integers(), st.just([""])),
    "top_k": st.one_of(st.integers(min_value=2 ** 63), st.integers(max_value=-2), st.just(0)),
    "frequency_penalty": st.one_of(st.floats(min_value=2.01, max_value=1e300), st.floats(max_value=-2.01,
                                                                                         min_value=-1e300)),
}


@st.composite
def malformed(draw) -> tuple[str, bytes]:
    """(path, raw body) that a correct server must refuse with a 4xx."""
    path = draw(st.sampled_from(sorted(_BASE)))
    body = json.loads(json.dumps(_BASE[path]))
    native = path == "/generate"
    kind = draw(st.sampled_from(["sampling", "wrong_type", "unknown", "bad_utf8", "non_finite", "truncated",
                                 "huge_list", "top_logprobs"]))
    if kind == "sampling":
        name = draw(st.sampled_from(sorted(_BAD_SAMPLING)))
        target = body["sampling_params"] if native else body
        target[name] = draw(_BAD_SAMPLING[name])
    elif kind == "wrong_type":
        main = {"/generate": "text", "/v1/completions": "prompt", "/v1/chat/completions": "messages"}[path]
        body[main] = draw(st.one_of(st.integers(), st.booleans(), st.dictionaries(_names, _junk, max_size=2),
                                    st.floats(allow_nan=False, allow_infinity=False)))
    elif kind == "unknown":
        body[draw(_names.filter(lambda n: n not in _KNOWN))] = draw(_junk)
    elif kind == "huge_list":
        key = "input_ids" if native else "prompt"
        body.pop("text", None)
        body[key] = draw(st.lists(st.integers(min_value=VOCAB, max_value=2 ** 40), min_size=1, max_size=2000))
    elif kind == "top_logprobs":
        if native:
            body.update(return_logprob=True, top_logprobs_num=draw(st.integers(min_value=21, max_value=2 ** 62)))
        elif path == "/v1/completions":
            body["logprobs"] = draw(st.integers(min_value=21, max_value=2 ** 62))
        else:
            body.update(logprobs=True, top_logprobs=draw(st.integers(min_value=21, max_value=2 ** 62)))
    raw = json.dumps(body).encode()
    if kind == "bad_utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\x80abc"]))
        at = raw.index(b"Hello")
        raw = raw[:at] + bad + raw[at:]
    elif kind == "non_finite":
        value = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"]))
        raw = raw[:-1] + b', "temperature": ' + value + b"}" if not native else \
            raw.replace(b'"max_new_tokens": 2', b'"max_new_tokens": 2, "temperature": ' + value)
    elif kind == "truncated":
        raw = raw[:draw(st.integers(min_value=0, max_value=len(raw) - 1))]  # a strict prefix of an object
    return path, raw


def _malformed_bodies(n: int) -> list[tuple[str, bytes]]:
    bodies = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(malformed())
    def collect(example):
        bodies.append(example)

    collect()
    return bodies


# ---- the soak ---------------------------------------------------------------------------------------------------
def _state(client) -> tuple[dict, dict]:
    info = client.get("/get_server_info").json()
    return info, info["internal_states"][0]


def _wait_idle(client, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info, state = _state(client)
        if state["waiting"] == 0 and state["running"] == 0 and info["in_flight_requests"] == 0:
            return info["slots"]
        assert time.monotonic() < deadline, f"the server did not go idle: {state}"
        time.sleep(0.05)


def test_soak_mixed_traffic(server):
    t_start = time.monotonic()
    headers = {"Authorization": f"Bearer {KEY}"}
    local = threading.local()

    def client():
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=server.url, headers=headers, timeout=120)
        return local.c

    main = httpx.Client(base_url=server.url, headers=headers, timeout=120)
    normal = _normal_requests()
    want = [_answer(kind, main.post(path, json=body)) for kind, path, body in normal]  # alone, in turn
    warm = main.post("/generate", json={"text": WARM + "Warm?", "sampling_params": {"max_new_tokens": 1}}).json()
    _, before = _state(main)

    malformed_bodies = _malformed_bodies(150)
    jobs = []
    for rep in range(4):
        jobs += [("normal", i) for i in range(len(normal))]
    jobs += [("streamed", i) for i in range(len(normal))]
    jobs += [("abort", i) for i in range(24)]
    jobs += [("malformed", i) for i in range(len(malformed_bodies))]
    jobs += [("hostile", i) for i in range(len(HOSTILE))]
    jobs += [("nokey", i) for i in range(6)]
    random.Random(0).shuffle(jobs)

    def run(job):
        what, i = job
        c = client()
        if what == "normal":
            kind, path, body = normal[i]
            return _answer(kind, c.post(path, json=body))
        if what == "streamed":
            kind, path, body = normal[i]
            return _streamed_answer(c, kind, path, body)
        if what == "abort":
            return _abort_mid_stream(c, i)
        if what == "malformed":
            path, raw = malformed_bodies[i]
            return c.post(path, content=raw, headers={"Content-Type": "application/json"})
        if what == "hostile":
            path, body, _ = HOSTILE[i]
            return c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
        # no key: /metrics and /flush_cache (GET or POST) are refused; a GET of /flush_cache with it is a 405
        r = [httpx.get(server.url + "/metrics"), httpx.get(server.url + "/flush_cache"),
             httpx.post(server.url + "/flush_cache"), c.get("/flush_cache")]
        return [x.status_code for x in r]

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(run, jobs))
    took = time.monotonic() - t_start

    for (what, i), got in zip(jobs, results):
        if what in ("normal", "streamed"):
            assert got == want[i], (what, normal[i], got, want[i])
        elif what == "abort":
            assert got == 2
        elif what in ("malformed", "hostile"):
            body = malformed_bodies[i] if what == "malformed" else HOSTILE[i][:2]
            assert 400 <= got.status_code < 500, (body, got.status_code, got.text[:300])
            assert got.json()["error"]["message"], body
        else:
            assert got == [401, 401, 401, 405], got
    slots = _wait_idle(main)
    _, after = _state(main)
    assert after["aborted"] - before["aborted"] >= 24  # every hung-up stream was aborted in the engine
    assert slots["consistent"] and slots["request_owned_slots"] == 0 and slots["resident_requests"] == 0, slots
    assert slots["protected_slots"] == 0, slots
    assert slots["free_slots"] + slots["cached_slots"] == slots["total_slots"], slots
    again = main.post("/generate", json={"text": WARM + "Warm?", "sampling_params": {"max_new_tokens": 1}}).json()
    assert again["meta_info"]["cached_tokens"] >= warm["meta_info"]["prompt_tokens"] - 1, again["meta_info"]
    print(f"soak: {len(jobs)} requests in {took:.1f} s")
    assert len(jobs) >= 300 and took < 240, (len(jobs), took)
