"""`lmc serve --dp 2`: two replicas of the embedded model (one core, one torch thread each) behind the real
SGLang gateway (sglang-router, cache_aware policy), driven by the openai client and by an lmc program's
run_batch. Every request is answered, every output equals the single engine's at temperature 0, both replicas
take traffic, the gateway sees lmc's workers as SGLang workers, and stopping leaves no process behind."""
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import lmc

from conftest import API_KEY as KEY

pytest.importorskip("sglang_router", reason="the gateway is not installed (pip install 'lmc[scale]')")

from lmc.server.replicas import ReplicaError, gateway_command, plan_replicas  # noqa: E402

from scale_support import LaunchedSet, alive, httpx  # noqa: E402

GREEDY = {"temperature": 0}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a fox", "Water boils at",
           "The three primary colors are", "import numpy as np\n", "My favourite season is", "2 + 2 ="]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    s = LaunchedSet(["--router-policy", "cache_aware"], tmp_path_factory.mktemp("scale") / "launcher.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw_client(replicas):
    return openai.OpenAI(base_url=replicas.url + "/v1", api_key=KEY, max_retries=0)


def test_gateway_registers_lmc_replicas_as_sglang_workers(replicas):
    workers = replicas.http.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r["url"] for r in replicas.info["replicas"])
    assert all(w["is_healthy"] and w["connection_mode"] == "HTTP" for w in workers)
    assert {w["metadata"]["model_path"] for w in workers} == {"smollm2-135m-instruct"}  # read from /server_info
    # the gateway polls /get_load and sums num_tokens (0 when idle); a replica answers in SGLang's shape
    loads = replicas.http.get("/get_loads").json()["workers"]
    assert len(loads) == 2 and all(isinstance(w["load"], int) for w in loads)
    with replicas.replica(0) as r0:
        (load,) = r0.get("/get_load").json()
        assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}
        assert load["num_reqs"] == 0 and load["num_tokens"] >= 0
        metrics = r0.get("/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc", "vllm:num_requests_running",
                 "sglang:num_queue_reqs", "sglang:token_usage", "lmc:num_queue_reqs"):
        assert f"\n{name}{{" in metrics, name
    # each replica is pinned to its own core, with one torch thread
    cpus = [tuple(r["cpus"]) for r in replicas.info["replicas"]]
    assert len(set(cpus)) == 2 and all(len(c) == len(os.sched_getaffinity(0)) // 2 for c in cpus)
    for r in replicas.info["replicas"]:
        assert os.sched_getaffinity(r["pid"]) == set(r["cpus"])
    # the gateway's own /flush_cache reaches every worker
    assert replicas.http.post("/flush_cache").json()["workers_flushed"] == 2


def test_openai_client_through_gateway_equals_single_engine(replicas, gw_client, engine, server):
    want = [r["text"] for r in engine.generate(PROMPTS, {"max_new_tokens": 12, **GREEDY})]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: the gateway balances what shares no prefix
        got = list(pool.map(lambda p: gw_client.completions.create(
            model="smollm2-135m-instruct", prompt=p, max_tokens=12, **GREEDY).choices[0].text, PROMPTS))
    assert got == want
    assert replicas.requests_served(0) > 0 and replicas.requests_served(1) > 0  # both replicas took traffic
    streamed = "".join(c.choices[0].text for c in gw_client.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=12, stream=True, **GREEDY) if c.choices)
    assert streamed == want[0]
    single = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = [c.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=10, **GREEDY)
            .choices[0].message.content for c in (gw_client, single)]
    assert chat[0] == chat[1] and chat[0]


@lmc.function
def qa(s, topic):
    s += "Q: Say one thing about " + topic + ".\nA:" + lmc.gen("fact", max_tokens=10, stop="\n")
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nQ: Another thing, number {i + 2}?\nA:" + lmc.gen("more", max_tokens=8, stop="\n")
    forks.join()


def test_run_batch_through_gateway_equals_single_engine(replicas, engine):
    topics = [{"topic": t} for t in ("the sea", "mountains", "owls", "bread", "trains", "rain")]
    remote = lmc.RuntimeEndpoint(replicas.url, api_key=KEY)
    got = qa.run_batch(topics, backend=remote, num_threads=6, return_exceptions=True, **GREEDY)
    want = qa.run_batch(topics, backend=lmc.Local(engine=engine), num_threads=6, **GREEDY)
    assert [type(s).__name__ for s in got] == ["ProgramState"] * len(topics)
    assert [(s["fact"], s["more"]) for s in got] == [(s["fact"], s["more"]) for s in want]
    # lmc.OpenAI on the gateway's /v1, as on one server
    api = lmc.OpenAI("smollm2-135m-instruct", base_url=replicas.url + "/v1", api_key=KEY, is_chat_model=False)
    got = qa.run_batch(topics[:3], backend=api, num_threads=3, return_exceptions=True, **GREEDY)
    assert [(s["fact"], s["more"]) for s in got] == [(s["fact"], s["more"]) for s in want[:3]]


def test_stop_leaves_no_process_behind(replicas):
    pids = set(replicas.pids)
    assert len(pids) == 3 and all(alive(p) for p in pids)
    assert replicas.stop() == 0
    assert [p for p in pids if alive(p)] == []


# ---- bad input (no processes started) --------------------------------------------------------------------------
def test_gateway_fields_accepted_at_their_defaults_only(server):
    """The fields the gateway adds to every forwarded request pass at the values it sends; asking for what lmc
    does not do is a 400 naming the field."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        ok = c.post("/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 1,
                                             "no_stop_trim": False, "return_hidden_states": False})
        assert ok.status_code == 200, ok.text
        ok = c.post("/generate", json={"text": "Hi", "model": None, "sampling_params": {"max_new_tokens": 1},
                                       "background": False, "no_logs": False, "return_bytes": False,
                                       "return_entropy": False, "return_hidden_states": False})
        assert ok.status_code == 200, ok.text
        bad = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "no_stop_trim": True})
        assert bad.status_code == 400 and "no_stop_trim" in bad.json()["error"]["message"]
        bad = c.post("/generate", json={"text": "Hi", "return_entropy": True})
        assert bad.status_code == 400 and "return_entropy" in bad.json()["error"]["message"]


def test_dp_zero_and_more_replicas_than_cores_are_refused(capsys):
    from lmc.cli import main

    assert main(["serve", "--dp", "0"]) == 2
    assert "--dp must be at least 1 (got 0)" in capsys.readouterr().err
    n = len(os.sched_getaffinity(0)) + 1
    assert main(["serve", "--dp", str(n), "--device", "cpu"]) == 2
    assert f"--dp {n} needs at least {n} cores" in capsys.readouterr().err
    with pytest.raises(ReplicaError, match="needs 2 GPUs; 1 visible"):
        plan_replicas(2, device="cuda", cpus=[0, 1, 2, 3], gpus=[0])
    plans = plan_replicas(2, cpus=[0, 1, 2, 3, 4], gpus=[])
    assert [p.cpus for p in plans] == [(0, 1, 2), (3, 4)] and [p.threads for p in plans] == [3, 2]
    assert [p.gpu for p in plan_replicas(2, cpus=[0, 1], gpus=[4, 5])] == [4, 5]
    with pytest.raises(ReplicaError, match="power_of_two needs at least 2 replicas"):
        gateway_command("127.0.0.1", 1, ["http://127.0.0.1:2"], "power_of_two", None, [])


def test_missing_gateway_names_the_extra(monkeypatch, capsys):
    from lmc.cli import main

    monkeypatch.setitem(sys.modules, "sglang_router", None)  # as if the package were not installed
    with pytest.raises(ReplicaError, match=r"pip install 'lmc\[scale\]'"):
        gateway_command("127.0.0.1", 1, ["http://127.0.0.1:2"], "cache_aware", None, [])
    assert main(["serve", "--dp", "1", "--device", "cpu"]) == 2
    assert "pip install 'lmc[scale]'" in capsys.readouterr().err
