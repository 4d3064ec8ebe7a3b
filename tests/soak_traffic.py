"""Mixed traffic for soaking a server (tests/test_soak.py runs one round; benchmarks/soak_bench.py runs rounds
for minutes): normal requests (native, OpenAI completions and chat, some constrained by a regex, each also
streamed), streams the client hangs up on, hostile requests (tests/hostile_requests.py), hypothesis-generated
malformed ones (wrong types, out-of-range numbers, huge lists, bad UTF-8, non-finite numbers, unknown fields,
truncated JSON), requests without the key, and a stream of distinct regexes.

    soak = Soak(url, api_key)
    soak.references()            # each normal request alone, in turn: its answer at temperature 0
    report = soak.round(seed)    # every kind of request, shuffled, from many threads; report.problems lists
                                 # every request whose outcome was wrong (empty when the server is right)
"""
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from hostile_requests import HOSTILE
from lmc.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

try:
    import httpx
except ImportError:  # installs that ship httpx under the name httpx2
    import httpx2 as httpx

WARM = ("You are a careful assistant. The following notes are shared by every ordinary request of this soak: "
        + " ".join(f"note {i} says that {i} squared is {i * i}." for i in range(30)) + "\n")
QUESTIONS = [f"Q: what is {i} plus {i + 3}?\nA:" for i in range(6)]
REGEXES = [rf"[0-9]{{{1 + i % 3}}}(, [a-z]{{2,{3 + i}}})?" for i in range(6)]  # a stream of distinct grammars
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
_KNOWN = {name for model in (GenerateRequest, CompletionRequest, ChatCompletionRequest)
          for name in (*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias),
                       *model.UNSUPPORTED, *model.INFORMATIONAL)}  # what a generated unknown field must avoid
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


def malformed_bodies(n: int, seed: int) -> list[tuple[str, bytes]]:
    """n malformed bodies, the same for the same seed."""
    bodies = []

    @hypothesis_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(malformed())
    def collect(example):
        bodies.append(example)

    collect()
    return bodies[:n]


# ---- a round ------------------------------------------------------------------------------------------------------
def server_state(client) -> tuple[dict, dict]:
    info = client.get("/get_server_info").json()
    return info, info["internal_states"][0]


def wait_idle(client, timeout: float = 120.0) -> dict:
    """The slot accounting once nothing is queued, running or in flight."""
    deadline = time.monotonic() + timeout
    while True:
        info, state = server_state(client)
        if state["waiting"] == 0 and state["running"] == 0 and info["in_flight_requests"] == 0:
            return info["slots"]
        assert time.monotonic() < deadline, f"the server did not go idle: {state}"
        time.sleep(0.05)


@dataclass
class RoundReport:
    requests: int = 0
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)  # requests by kind
    problems: list = field(default_factory=list)  # (kind, what was sent, what came back) of each wrong outcome


class Soak:
    def __init__(self, url: str, api_key: str, threads: int = 24, repeats: int = 4, aborts: int = 24,
                 malformed: int = 150, fresh_regexes: int = 12):
        self.url, self.headers = url, {"Authorization": f"Bearer {api_key}"}
        self.threads, self.repeats, self.aborts = threads, repeats, aborts
        self.n_malformed, self.fresh_regexes = malformed, fresh_regexes
        self.normal = _normal_requests()
        self.want: list | None = None
        self.main = httpx.Client(base_url=url, headers=self.headers, timeout=120)
        self._local = threading.local()
        # Threads and their clients live as long as the Soak: rounds leave no client-side garbage behind, so that
        # memory growth across rounds is the server's.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="soak-client")
        self._clients: list = [self.main]

    def _client(self, keyed: bool = True):
        if not hasattr(self._local, "c"):
            self._local.c = httpx.Client(base_url=self.url, headers=self.headers, timeout=120)
            self._local.anon = httpx.Client(base_url=self.url, timeout=120)
            self._clients += [self._local.c, self._local.anon]
        return self._local.c if keyed else self._local.anon

    def close(self) -> None:
        self._pool.shutdown()
        for c in self._clients:
            c.close()

    def references(self) -> None:
        self.want = [_answer(kind, self.main.post(path, json=body)) for kind, path, body in self.normal]

    def warm_cached(self) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of a request on the warm prefix."""
        m = self.main.post("/generate", json={"text": WARM + "Warm?", "sampling_params": {"max_new_tokens": 1}}
                           ).json()["meta_info"]
        return m["prompt_tokens"], m["cached_tokens"]

    def round(self, seed: int = 0) -> RoundReport:
        assert self.want is not None, "call references() first"
        bad = malformed_bodies(self.n_malformed, seed)
        jobs = [("normal", i) for _ in range(self.repeats) for i in range(len(self.normal))]
        jobs += [("streamed", i) for i in range(len(self.normal))]
        jobs += [("abort", i) for i in range(self.aborts)]
        jobs += [("malformed", i) for i in range(len(bad))]
        jobs += [("hostile", i) for i in range(len(HOSTILE))]
        jobs += [("nokey", i) for i in range(6)]
        jobs += [("regex", i) for i in range(self.fresh_regexes)]
        random.Random(seed).shuffle(jobs)
        _, before = server_state(self.main)

        def run(job):
            what, i = job
            c = self._client()
            try:
                return self._run(c, what, i, bad, seed)
            except Exception as e:  # noqa: BLE001 - a transport error is a wrong outcome too
                return e

        t0 = time.monotonic()
        results = list(self._pool.map(run, jobs))
        report = RoundReport(requests=len(jobs), seconds=time.monotonic() - t0)
        for (what, i), got in zip(jobs, results):
            report.counts[what] = report.counts.get(what, 0) + 1
            sent = self._sent(what, i, bad)
            if isinstance(got, Exception):
                report.problems.append((what, sent, repr(got)))
            elif not self._right(what, i, got):
                report.problems.append((what, sent, getattr(got, "text", got)))
        _, after = server_state(self.main)
        if after["aborted"] - before["aborted"] < self.aborts:
            report.problems.append(("abort", "streams hung up on", f"only {after['aborted'] - before['aborted']} "
                                    "aborted in the engine"))
        return report

    def _sent(self, what: str, i: int, bad) -> object:
        if what in ("normal", "streamed"):
            return self.normal[i]
        if what == "malformed":
            return bad[i]
        if what == "hostile":
            return HOSTILE[i][:2]
        return (what, i)

    def _run(self, c, what: str, i: int, bad, seed: int):
        if what == "normal":
            kind, path, body = self.normal[i]
            return _answer(kind, c.post(path, json=body))
        if what == "streamed":
            kind, path, body = self.normal[i]
            return _streamed_answer(c, kind, path, body)
        if what == "abort":
            return _abort_mid_stream(c, i)
        if what == "malformed":
            path, raw = bad[i]
            return c.post(path, content=raw, headers={"Content-Type": "application/json"})
        if what == "hostile":
            path, body, _ = HOSTILE[i]
            return c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
        if what == "regex":  # a grammar no request used before: compiled, cached, evicted in time
            rx = f"[0-9]{{1,3}}-s{seed}-r{i}"
            r = c.post("/generate", json={"text": "Code:", "sampling_params": {"max_new_tokens": 16, "regex": rx,
                                                                                 **GREEDY}})
            return r.status_code, r.json().get("text"), rx
        # no key: /metrics and /flush_cache (GET or POST) are refused; a GET of /flush_cache with it is a 405
        anon = self._client(keyed=False)
        r = [anon.get("/metrics"), anon.get("/flush_cache"), anon.post("/flush_cache"), c.get("/flush_cache")]
        return [x.status_code for x in r]

    def _right(self, what: str, i: int, got) -> bool:
        if what in ("normal", "streamed"):
            return got == self.want[i]
        if what == "abort":
            return got == 2
        if what in ("malformed", "hostile"):
            try:
                return 400 <= got.status_code < 500 and bool(got.json()["error"]["message"])
            except ValueError:
                return False
        if what == "regex":
            status, text, rx = got
            return status == 200 and re.fullmatch(rx, text or "") is not None
        return got == [401, 401, 401, 405]
