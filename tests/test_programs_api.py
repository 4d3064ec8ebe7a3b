"""POST /v1/programs against the real server (one per module, on the session engine): a static compiled instance
is one HTTP request and gives what the interpreted program gives over RuntimeEndpoint at temperature 0; a program
with a graph break makes one request per segment (none for a segment without model calls); bad programs get a 400 naming the problem while good calls go
on; streaming (each variable as the engine produces it, then each instance's result); per-instance errors; the fallback to per-call execution on a server without the route; and the
plan's program hints reaching the engine's requests (Req.program)."""
import json
import threading
import time

import pytest

import lmc
from lmc.compiler.hints import segment_hints
from lmc.compiler.pipeline import Target
from lmc.ir.export import graph_dict
from lmc.ir.text import print_graph
from lmc.server import ServerThread, create_app
from lmc.server.programs_api import ProgramLimits

from conftest import API_KEY as KEY
from programs_support import CountingApp, chain, forked, forked_after_gen
from test_examples import load

try:
    import httpx
except ImportError:  # installs that ship httpx under the name httpx2
    import httpx2 as httpx

judge = load("judge").judge
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def counted(engine):
    app = CountingApp(create_app(engine, api_key=KEY, program_limits=ProgramLimits(
        max_fork_width=4, max_total_tokens=4096, max_instances=8)))
    with ServerThread(app) as srv:
        ep = lmc.RuntimeEndpoint(srv.url, api_key=KEY)
        yield srv, app, ep
        ep.shutdown()


def _post(srv, body, **kw):
    return httpx.post(srv.url + "/v1/programs", json=body, headers=HEADERS, timeout=300, **kw)


def test_static_instance_is_one_request_and_matches_interpreted(counted):
    srv, app, ep = counted
    interpreted = chain.run(topic="the moon", backend=ep, temperature=0)
    assert ep.capabilities.server_plans
    app.paths.clear()
    compiled = chain.compile().run(topic="the moon", backend=ep, temperature=0)
    assert app.paths == ["/v1/programs"]
    assert compiled.variables() == interpreted.variables()
    assert compiled.text() == interpreted.text()
    usage = lmc.backend.openai.program_usage(compiled)
    assert usage.calls >= 6 and usage.completion_tokens > 0


@pytest.mark.parametrize("program", [forked, forked_after_gen])
def test_forks_and_batches_match_interpreted(counted, engine, program):
    srv, app, ep = counted
    topics = [{"topic": t} for t in ("rivers", "stars", "bread")]
    interpreted = program.run_batch(topics, backend=ep, temperature=0)
    app.paths.clear()
    forked_branches = engine.stats()["forked_branches"]
    compiled = program.compile().run_batch(topics, backend=ep, temperature=0)
    # one request per instance, plus the batch's shared-prefix hint (a commit: compiled.py's batch_prefix)
    assert app.paths.count("/v1/programs") == 3 and app.paths.count("/generate") <= 1 and len(app.paths) <= 4
    assert [s.variables() for s in compiled] == [s.variables() for s in interpreted]
    # a fork after a gen: its branches ran as child requests of the instance's chain in the engine
    assert engine.stats()["forked_branches"] - forked_branches == (6 if program is forked_after_gen else 0)


@lmc.function
def gen_then_host(s, topic):
    s += "Topic: " + topic + "\nWord:" + lmc.gen("word", max_tokens=3, stop="\n")
    s["shout"] = s["word"].strip().upper()  # host code reading the gen's value: a break, and no call after it


def test_tree_of_thought_is_one_request_and_matches_interpreted(counted):
    """Its host code (scores from the selects' logprobs, the best branch) runs on the server as expressions."""
    srv, app, ep = counted
    tot = load("tree_of_thought").tree_of_thought
    interpreted = tot.run(question="What is 2 + 3?", backend=ep, temperature=0)
    app.paths.clear()
    compiled = tot.compile().run(question="What is 2 + 3?", backend=ep, temperature=0)
    assert app.paths == ["/v1/programs"]
    assert compiled.variables() == interpreted.variables() and compiled.text() == interpreted.text()


def test_an_expression_that_fails_fails_its_instance_alone(counted):
    """The server evaluates a plan's expressions: one that raises (here a division by zero) is that instance's
    error, after the calls before it ran; the server serves the next call as before."""
    srv, _, ep = counted
    tot = load("tree_of_thought").tree_of_thought
    bad = _plan_json(tot, ep)
    scores = next(o for o in bad["ops"] if o["op"] == "set")
    scores["expr"] = ["/", ["item", ["item", ["item", ["meta", "correct"], 0], "normalized_prompt_logprobs"], 0], 0]
    r = _post(srv, {"program": bad, "arguments": [{"question": "What is 2 + 3?"}], "sampling": {"temperature": 0}})
    assert r.status_code == 200, r.text
    [x] = r.json()["instances"]
    assert "division by zero" in x["error"]["message"] and len(x["variables"]["thought"]) == 3
    r = _post(srv, {"program": _plan_json(tot, ep), "arguments": [{"question": "What is 2 + 3?"}],
                    "sampling": {"temperature": 0}})
    assert r.status_code == 200 and r.json()["instances"][0]["error"] is None


def test_segment_without_model_calls_runs_on_the_client(counted):
    srv, app, ep = counted
    interpreted = gen_then_host.run(topic="rain", backend=ep, temperature=0)
    program = gen_then_host.compile()
    fallback, breaks = program.breaks(topic="rain")
    assert not fallback and len(breaks) == 1  # two segments
    app.paths.clear()
    compiled = program.run(topic="rain", backend=ep, temperature=0)
    assert app.paths == ["/v1/programs"]  # the segment after the break holds no engine work: no request
    assert compiled.variables() == interpreted.variables() and compiled["shout"] == compiled["word"].strip().upper()


def test_graph_break_makes_one_request_per_segment(counted):
    srv, app, ep = counted
    args = dict(question="What is the capital of France?", answer="Paris.")
    interpreted = judge.run(**args, backend=ep, temperature=0)
    app.paths.clear()
    compiled = judge.compile().run(**args, backend=ep, temperature=0)
    assert app.paths == ["/v1/programs", "/v1/programs"]  # the host code between them ran here
    assert compiled["scores"] == interpreted["scores"] and compiled["verdict"] == interpreted["verdict"]
    assert compiled.text() == interpreted.text()


def test_direct_call_many_instances_and_streaming(counted):
    srv, _, _ = counted
    g = chain.compile().graph()
    body = {"program": print_graph(g), "arguments": [{"topic": t} for t in ("tea", "salt", "iron")],
            "sampling": {"temperature": 0}}
    r = _post(srv, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [x["index"] for x in out["instances"]] == [0, 1, 2]
    assert all(x["error"] is None and set(x["variables"]) >= {"fact0", "true2"} for x in out["instances"])
    assert out["usage"]["completion_tokens"] == sum(x["usage"]["completion_tokens"] for x in out["instances"])
    with httpx.stream("POST", srv.url + "/v1/programs", json={**body, "stream": True}, headers=HEADERS,
                      timeout=300) as s:
        events = [line[5:].strip() for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    streamed = sorted((e for e in map(json.loads, events[:-1]) if e["object"] == "program.instance"),
                      key=lambda e: e["index"])
    assert [e["variables"] for e in streamed] == [x["variables"] for x in out["instances"]]
    # the same program as graph JSON runs the same
    r = _post(srv, {**body, "program": graph_dict(g)})
    assert [x["variables"] for x in r.json()["instances"]] == [x["variables"] for x in out["instances"]]


def _plan_json(program, ep, **concrete) -> dict:
    """The program's first segment lowered for an lmc server, as data (what `lmc compile --emit plan` prints)."""
    target = Target("endpoint", ep.chat_template, None, ep.capabilities)
    return json.loads(json.dumps(program.compile().plan_for(target, **concrete).to_json()))


def test_lowered_plan_json_runs_like_the_interpreted_program(counted):
    srv, _, ep = counted
    for program, topics in ((chain, ("tea", "salt")), (forked, ("rivers",))):
        interpreted = program.run_batch([{"topic": t} for t in topics], backend=ep, temperature=0)
        r = _post(srv, {"program": _plan_json(program, ep), "arguments": [{"topic": t} for t in topics],
                        "sampling": {"temperature": 0}})
        assert r.status_code == 200, r.text
        out = r.json()["instances"]
        assert all(x["error"] is None for x in out), out
        assert [x["variables"] for x in out] == [s.variables() for s in interpreted]
        assert [x["text"] for x in out] == [s.text() for s in interpreted]


def test_bad_plans_get_a_400_naming_the_operation(counted):
    srv, _, ep = counted
    unknown = _plan_json(chain, ep)
    unknown["ops"][1]["op"] = "teleport"
    wide = _plan_json(forked, ep)
    fork = next(o for o in wide["ops"] if o["op"] == "fork")
    fork["branches"] = fork["branches"] * 5  # 10 branches, over the fixture's max_fork_width of 4
    typed = _plan_json(chain, ep)
    gen = next(o for o in typed["ops"] if o["op"] == "generate")
    gen["params"]["max_new_tokens"] = "lots"
    code = _plan_json(chain, ep)
    code["ops"].insert(1, {"op": "set", "node": 999, "name": "x", "expr": ["exec", "import os"]})
    for plan, expected in ((unknown, "ops[1]"), (unknown, "teleport"),
                           (code, "ops[1] (set %999): expr: [\"exec\", \"import os\"] is not an expression"),
                           (wide, f"%{fork['node']} (fork): a fork of 10 branches is wider"),
                           (typed, f"%{gen['node']} (generate): max_new_tokens must be a non-negative integer"),
                           ({**typed, "version": 99}, "version 99")):
        r = _post(srv, {"program": plan, "arguments": [{"topic": "x"}]})
        assert r.status_code == 400, (expected, r.text)
        assert expected in r.json()["error"]["message"], r.text
    good = _plan_json(chain, ep)
    node = next(o["node"] for o in good["ops"] if o["op"] == "generate")
    for hints, expected in (([], "hints must map node ids"),
                            ({str(node): {"calls_left": -1, "tokens_left": None, "next_use": None}},
                             f"hints['{node}'].calls_left must be a non-negative integer")):
        r = _post(srv, {"program": good, "arguments": [{"topic": "x"}], "hints": hints})
        assert r.status_code == 400, (expected, r.text)
        assert expected in r.json()["error"]["message"], r.text


def test_one_failing_instance_leaves_the_others(counted):
    srv, _, _ = counted
    g = print_graph(chain.compile().graph())
    r = _post(srv, {"program": g, "arguments": [{"topic": "tea"}, {"topic": "word " * 20000}],
                    "sampling": {"temperature": 0}})
    assert r.status_code == 200
    ok, bad = r.json()["instances"]
    assert ok["error"] is None and ok["variables"]["fact0"] is not None
    assert "context length" in bad["error"]["message"]


def _bad_bodies():
    g = chain.compile().graph()
    unknown = graph_dict(g)
    unknown["nodes"][1]["kind"] = "teleport"
    wide = graph_dict(forked.compile().graph())
    fork = next(n for n in wide["nodes"] if n["kind"] == "fork")
    fork["size"] = 9  # the branches as listed no longer match: the width check comes first
    big = graph_dict(g)
    gen = next(n for n in big["nodes"] if n["kind"] == "gen")
    gen["params"]["max_new_tokens"] = 5000
    return [
        ({"program": "program broken( {"}, "not a valid lmc IR text"),
        ({"program": unknown}, "teleport"),
        ({"program": wide, "arguments": [{"topic": "x"}]}, f"%{fork['id']} (fork): a fork of 9 branches is wider"),
        ({"program": big, "arguments": [{"topic": "x"}]}, f"(%{gen['id']} gen 'fact0' alone 5000), more than this "
                                                          "server's budget of 4096 tokens per call (max_total_tokens)"),
        ({"program": print_graph(g), "arguments": [{"topic": "x"}] * 9}, "max_instances"),
        ({"program": print_graph(g), "arguments": [{}]}, "lacks parameter(s) ['topic']"),
        ({"program": print_graph(g), "arguments": [{"topic": "x"}], "sampling": {"temprature": 0}}, "temprature"),
    ]


def test_bad_programs_get_a_400_naming_the_problem_while_others_run(counted):
    srv, _, _ = counted
    good = {"program": print_graph(chain.compile().graph()), "arguments": [{"topic": "milk"}],
            "sampling": {"temperature": 0}}
    results, stop = [], threading.Event()

    def keep_serving():
        while not stop.is_set():
            results.append(_post(srv, good).status_code)

    t = threading.Thread(target=keep_serving)
    t.start()
    try:
        for body, expected in _bad_bodies():
            r = _post(srv, body)
            assert r.status_code == 400, (expected, r.text)
            assert expected in r.json()["error"]["message"], r.text
    finally:
        stop.set()
        t.join()
    assert results and set(results) == {200}
    assert httpx.post(srv.url + "/v1/programs", json=good, timeout=60).status_code == 401  # the API key applies


def test_fallback_to_per_call_on_a_server_without_the_route(engine):
    app = CountingApp(create_app(engine, api_key=KEY), missing={"/v1/programs"})
    with ServerThread(app) as srv:
        ep = lmc.RuntimeEndpoint(srv.url, api_key=KEY)
        try:
            compiled = chain.compile().run(topic="the sea", backend=ep, temperature=0)
            assert not ep.capabilities.server_plans  # switched off after the 404
            assert app.paths.count("/v1/programs") == 1 and app.paths.count("/generate") >= 6
            assert compiled.variables() == chain.run(topic="the sea", backend=ep, temperature=0).variables()
        finally:
            ep.shutdown()


def test_program_field_on_generate_and_openai_routes(counted):
    srv, _, _ = counted
    hints = {"instance": "abc", "calls_left": 3, "tokens_left": 40, "next_use": 1, "program": "p"}
    r = httpx.post(srv.url + "/generate", headers=HEADERS, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "program": hints})
    assert r.status_code == 200, r.text
    for body, field in ((dict(hints, calls_left="3"), "program.calls_left"), ("abc", "program"),
                        (dict(hints, colour=1), "colour")):
        r = httpx.post(srv.url + "/v1/completions", headers=HEADERS, json={
            "prompt": "Hi", "max_tokens": 2, "program": body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "program"
    r = httpx.post(srv.url + "/v1/chat/completions", headers=HEADERS, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "program": hints})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("via", ["local", "server"])
def test_hints_reach_the_engine_requests(engine, counted, via):
    """In process, and through /v1/programs (the client's plan carries its hints table: plan data has no graph).
    The static chain is one engine request (continuation): its hints move on with each call."""
    seen = []
    sched = engine.scheduler
    add, advance = sched.add, sched._continuation.advance
    srv, app, ep = counted

    def recording_add(req):  # the scheduler thread calls it for each request it receives
        seen.append(req.program)
        return add(req)

    def recording_advance(req, reason, text):  # ... and this as a chain request goes on to its next call
        went_on = advance(req, reason, text)
        if went_on:
            seen.append(req.program)
        return went_on

    sched.add, sched._continuation.advance = recording_add, recording_advance
    app.bodies.clear()
    try:
        chain.compile().run(topic="glass", backend=lmc.Local(engine=engine) if via == "local" else ep,
                            temperature=0)
    finally:
        del sched.add, sched._continuation.advance
    if via == "server":
        assert [p for p, _ in app.bodies] == ["/v1/programs"] and app.bodies[0][1]["hints"]
    hinted = [h for h in seen if h is not None]
    assert len(hinted) == len(seen) >= 6
    assert len({h.instance for h in hinted}) == 1 and {h.program for h in hinted} == {"chain"}
    calls = [h.calls_left for h in hinted]
    assert calls[0] == 6 and calls[-1] == 1 and calls == sorted(calls, reverse=True)
    assert hinted[0].tokens_left == 3 * 6 + 3 and hinted[-1].tokens_left == 1
    assert hinted[-1].next_use is None and all(h.next_use == 1 for h in hinted[:-1] if h.calls_left > 1)


def test_segment_hints_of_a_fork():
    g = forked.compile().graph()
    hints = segment_hints(g)
    gens = {g.node(n).attrs["name"]: (n, h) for n, h in hints.items() if g.node(n).kind == "gen"}
    (_, best) = gens["best"]
    assert best.calls_left == 1 and best.next_use is None and best.tokens_left == 6
    branch = [h for n, h in hints.items() if g.node(n).attrs["name"] != "best"]
    # a branch's last call: the final gen extends the parent's text, the prefix the branches start with, after the
    # other branch's call (the ledger counts every finished request as a step) and itself
    assert all(h.calls_left == 2 and h.next_use == 2 for h in branch)
    assert {h.tokens_left for h in branch} == {18}  # both branches (concurrent) and the final gen


@pytest.mark.parametrize("server", ["lmc", "dynamo"])
def test_openai_backend_sends_the_hints(counted, server):
    srv, app, _ = counted
    be = lmc.OpenAI("smollm2", base_url=srv.url + "/v1", api_key=KEY, server=server)
    try:
        app.bodies.clear()
        chain.compile().run(topic="ice", backend=be, temperature=0)
    finally:
        be.shutdown()
    sent = [b for p, b in app.bodies if p.startswith("/v1/")]
    assert len(sent) >= 6
    if server == "lmc":
        ids = {b["program"]["instance"] for b in sent}
        assert len(ids) == 1 and sent[0]["program"]["calls_left"] == 6 and sent[0]["program"]["program"] == "chain"
    else:  # NVIDIA Dynamo's shape: the instance is the session and the trajectory
        ids = {b["nvext"]["agent_context"]["session_id"] for b in sent}
        assert len(ids) == 1 and sent[0]["nvext"]["agent_hints"]["osl"] == 3 * 6 + 3
        assert all("program" not in b for b in sent)


@lmc.function
def long_tail(s, topic):
    """A short gen, then a long one: the first variable is known long before the instance ends."""
    s += "Topic: " + topic + "\nFact:" + lmc.gen("first", max_tokens=4, stop="\n")
    s += "\nStory:" + lmc.gen("story", max_tokens=40, ignore_eos=True)


def _events(srv, body) -> list[tuple[float, dict]]:
    """The streamed call's events, each with the time it arrived, up to (and checking) the end marker."""
    out = []
    with httpx.stream("POST", srv.url + "/v1/programs", json={**body, "stream": True}, headers=HEADERS,
                      timeout=300) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data:"):
                out.append((time.perf_counter(), line[5:].strip()))
    assert out[-1][1] == "[DONE]"
    return [(t, json.loads(e)) for t, e in out[:-1]]


def _by_instance(events) -> dict[int, list[dict]]:
    per: dict[int, list[dict]] = {}
    for _, e in events:
        per.setdefault(e["index"], []).append(e)
    return per


def test_streaming_sends_each_variable_in_program_order_then_the_result(counted):
    srv, _, _ = counted
    body = {"program": print_graph(chain.compile().graph()), "arguments": [{"topic": "tea"}, {"topic": "salt"}],
            "sampling": {"temperature": 0}}
    plain = _post(srv, body).json()  # the non-streamed response is as before: instances only, no variable events
    assert set(plain) == {"id", "object", "created", "program", "instances", "usage", "latency"}
    assert plain["object"] == "program.run" and all("variable" not in x for x in plain["instances"])
    per = _by_instance(_events(srv, body))
    assert sorted(per) == [0, 1]
    for i, evs in per.items():
        *variables, result = evs
        assert result["object"] == "program.instance" and result["error"] is None
        assert all(e["object"] == "program.variable" for e in variables)
        assert [e["variable"] for e in variables] == ["fact0", "true0", "fact1", "true1", "fact2", "true2"]
        assert {e["variable"]: e["value"] for e in variables} == result["variables"] == plain["instances"][i]["variables"]
        assert {e["variable"]: e["meta_info"] for e in variables} == result["meta_info"]
        assert variables[0]["meta_info"]["completion_tokens"] > 0  # a gen's meta info, from the engine
        assert result["usage"]["calls"] == plain["instances"][i]["usage"]["calls"] == 6  # (tokens: cache-dependent)
    # a fork's branches reach the instance at the join: their variable as one list, then what follows the join
    body = {"program": print_graph(forked.compile().graph()), "arguments": [{"topic": "rivers"}],
            "sampling": {"temperature": 0}}
    *variables, result = _by_instance(_events(srv, body))[0]
    assert [(e["variable"], type(e["value"])) for e in variables] == [("idea", list), ("best", str)]
    assert {e["variable"]: e["value"] for e in variables} == result["variables"]
    # ... also where they are the engine's child requests of the chain before the fork (engine-side forks)
    body["program"] = print_graph(forked_after_gen.compile().graph())
    *variables, result = _by_instance(_events(srv, body))[0]
    assert [(e["variable"], type(e["value"])) for e in variables] == [("fact", str), ("idea", list), ("best", str)]
    assert {e["variable"]: e["value"] for e in variables} == result["variables"]


def test_a_variable_streams_as_the_engine_produces_it(counted):
    srv, _, _ = counted
    body = {"program": print_graph(long_tail.compile().graph()), "arguments": [{"topic": "tea"}],
            "sampling": {"temperature": 0}}
    (t_first, first), (t_story, story), (t_end, result) = _events(srv, body)
    assert (first["variable"], story["variable"], result["object"]) == ("first", "story", "program.instance")
    assert result["meta_info"]["story"]["completion_tokens"] == 40
    # the first variable came while the engine still decoded the 40 tokens of the second (buffered until the
    # instance ended, it would come within a millisecond of the result; 40 decode steps take over 0.25 s on CI's
    # CPU and ~0.15 s on an H200)
    assert t_end - t_first > 0.03, (t_first, t_story, t_end)
    assert t_end - t_story < t_end - t_first


@lmc.function
def two_facts(s, topic, filler):
    """Two gens with the argument `filler` between them: a filler past the context fails the second alone."""
    s += "Topic: " + topic + "\nFact:" + lmc.gen("first", max_tokens=4, stop="\n")
    s += filler + "\nFact:" + lmc.gen("second", max_tokens=4, stop="\n")


def test_a_failing_instance_streams_its_error_while_another_streams_its_variables(counted):
    srv, _, _ = counted
    huge = "word " * 20000  # past the model's context
    body = {"program": print_graph(two_facts.compile().graph()), "sampling": {"temperature": 0},
            "arguments": [{"topic": "tea", "filler": ""}, {"topic": huge, "filler": ""},
                          {"topic": "salt", "filler": huge}]}
    per = _by_instance(_events(srv, body))
    *variables, ok = per[0]
    assert ok["error"] is None and [e["variable"] for e in variables] == ["first", "second"]
    (at_first,) = per[1]  # failed at its first call: no variable, its result names the error
    assert at_first["object"] == "program.instance" and "context length" in at_first["error"]["message"]
    set_first, at_second = per[2]  # failed at its second call: the first variable, then the error
    assert set_first["variable"] == "first" and set_first["value"] == at_second["variables"]["first"]
    assert "second" not in at_second["variables"] and "context length" in at_second["error"]["message"]


@lmc.function
def runaway(s, topic):
    """A short gen, then one that would decode for minutes unless aborted."""
    s += "Topic: " + topic + "\nFact:" + lmc.gen("first", max_tokens=4, stop="\n")
    s += "\nStory:" + lmc.gen("story", max_tokens=1500, ignore_eos=True)


@lmc.function
def runaway_fork(s, topic):
    s += "Topic: " + topic + "\nFact:" + lmc.gen("first", max_tokens=4, stop="\n")
    forks = s.fork(2)  # the engine's child requests of the chain: aborted with it
    for k, f in enumerate(forks):
        f += f"\nStory {k}:" + lmc.gen("story", max_tokens=1500, ignore_eos=True)
    forks.join()


@pytest.mark.parametrize("program, requests", [(runaway, 1), (runaway_fork, 3)])
def test_hanging_up_mid_stream_aborts_the_instance(counted, engine, program, requests):
    """A client that hangs up after the first variable's event has the instance's engine chain aborted (with
    its fork's branches, the engine's child requests): decoding stops long before the 1500 tokens it asked for,
    and no KV slot stays owned."""
    srv, _, _ = counted
    before = engine.stats()
    body = {"program": print_graph(program.compile().graph()), "arguments": [{"topic": "tea"}], "stream": True,
            "sampling": {"temperature": 0}}
    with httpx.stream("POST", srv.url + "/v1/programs", json=body, headers=HEADERS, timeout=300) as s:
        first = next(json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:"))
    assert first["object"] == "program.variable" and first["variable"] == "first"
    deadline = time.monotonic() + 60
    # (between its two calls the chain is neither running nor waiting: wait for the abort itself, then for no
    # request to hold the engine)
    while engine.stats()["aborted"] < before["aborted"] + requests or engine.load()["resident_requests"]:
        assert time.monotonic() < deadline, f"the chain was not aborted: {engine.load()}"
        time.sleep(0.01)
    st, load = engine.stats(), engine.load()
    assert st["aborted"] == before["aborted"] + requests
    assert st["decode_forwards"] - before["decode_forwards"] < 300
    assert load["request_owned_slots"] == 0 and load["waiting_requests"] == 0
    assert load["free_slots"] + load["cached_slots"] == load["total_slots"]
