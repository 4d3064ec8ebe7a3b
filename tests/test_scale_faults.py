"""Faults and affinity with `lmc serve --dp 2` behind the real gateway (sglang-router, `manual` policy: sticky by
the X-SMG-Routing-Key header that lmc.RuntimeEndpoint sends once per program instance).

- affinity: every call of one program reaches the replica that holds its prefix;
- a replica killed with SIGKILL in the middle of a run_batch: no program is lost silently (each one finishes or
  carries a clear error), the launcher restarts the replica and the gateway sends to it again;
- a replica answering 503 (its admission limit, --max-pending, is full) sheds the gateway's traffic to the other;
- the launcher killed with SIGKILL leaves no child behind.
"""
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import lmc

from conftest import API_KEY as KEY

pytest.importorskip("sglang_router", reason="the gateway is not installed (pip install 'lmc[scale]')")

from scale_support import LaunchedSet, alive  # noqa: E402

GREEDY = {"temperature": 0}
MAX_PENDING = 6


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    s = LaunchedSet(["--router-policy", "manual", "--max-pending", str(MAX_PENDING)],
                    tmp_path_factory.mktemp("scale_faults") / "launcher.log")
    yield s
    s.stop()


@lmc.function
def chain(s, topic, n=24):
    s += topic + " is what this note is about.\nFirst:" + lmc.gen("first", max_tokens=n, stop="\n")
    s += "\nSecond:" + lmc.gen("second", max_tokens=n, stop="\n")
    s += "\nThird:" + lmc.gen("third", max_tokens=8, stop="\n")


TOPICS = ["Owls", "Bread", "Trains", "Volcanoes", "Chess", "Rain"]


def _served(replicas) -> list[int]:
    return [replicas.requests_served(i) for i in range(2)]


def test_routing_key_pins_requests_to_one_replica(replicas):
    for key in ("program-a", "program-b"):
        before = _served(replicas)
        for text in ("Apples are", "Zebras live in", "The number seven", "Quartz is a", "Northern lights"):
            r = replicas.http.post("/generate", headers={"X-SMG-Routing-Key": key},
                                   json={"text": text, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
        delta = sorted(a - b for a, b in zip(_served(replicas), before))
        assert delta == [0, 5], delta


def test_every_call_of_a_program_reaches_the_replica_holding_its_prefix(replicas):
    remote = lmc.RuntimeEndpoint(replicas.url, api_key=KEY)
    states = chain.run_batch([{"topic": t} for t in TOPICS], backend=remote, num_threads=3, **GREEDY)
    for st in states:
        # the later calls find the program's earlier text in the replica's radix cache: same replica
        assert st.get_meta_info("second")["cached_tokens"] >= 8, st.get_meta_info("second")
        assert st.get_meta_info("third")["cached_tokens"] >= st.get_meta_info("second")["cached_tokens"]


def test_sigkill_mid_batch_loses_no_program_and_the_replica_rejoins(replicas):
    remote = lmc.RuntimeEndpoint(replicas.url, api_key=KEY)
    victim = replicas.info["replicas"][0]
    out: dict = {}
    batch = threading.Thread(target=lambda: out.setdefault("states", chain.run_batch(
        [{"topic": t, "n": 40} for t in TOPICS], backend=remote, num_threads=len(TOPICS),
        return_exceptions=True, **GREEDY)))
    batch.start()
    with replicas.replica(0) as r0:  # kill it while it is decoding several programs' calls
        deadline = time.monotonic() + 60
        while r0.get("/get_load").json()[0]["num_reqs"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    batch.join(timeout=120)
    states = out["states"]
    assert len(states) == len(TOPICS)
    finished = [s for s in states if isinstance(s, lmc.ProgramState)]
    failed = [s for s in states if isinstance(s, BaseException)]
    assert len(finished) + len(failed) == len(TOPICS)
    for s in finished:  # a finished program has every variable
        assert all(isinstance(s[v], str) for v in ("first", "second", "third"))
    for e in failed:  # a failed one says why (the gateway's status, or the connection that broke)
        assert "HTTP" in str(e) or "onnect" in str(e), repr(e)
    assert finished, "the surviving replica should finish the programs routed to it"

    restarted = replicas.wait_event("restarted", timeout=30)
    assert restarted["replica"] == "replica 0" and not alive(victim["pid"])
    deadline = time.monotonic() + 180
    while not (replicas.replica_up(0) and replicas.healthy_workers() == 2):  # up, and the gateway knows it
        assert time.monotonic() < deadline, "the restarted replica did not rejoin the gateway"
        time.sleep(0.5)
    # new programs are assigned to it again (its fresh process counts from 0)
    for _ in range(30):
        r = replicas.http.post("/generate", headers={"X-SMG-Routing-Key": uuid.uuid4().hex},
                               json={"text": "Rejoined?", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
        if replicas.requests_served(0) > 0:
            break
    assert replicas.requests_served(0) > 0


def test_overloaded_replica_sheds_load_to_the_other(replicas):
    body = {"sampling_params": {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}}
    with replicas.replica(0) as r0, ThreadPoolExecutor(MAX_PENDING) as pool:
        before = _served(replicas)
        # fill replica 0's admission limit directly, bypassing the gateway
        direct = [pool.submit(r0.post, "/generate", json={**body, "text": f"Long story {i}:"})
                  for i in range(MAX_PENDING)]
        deadline = time.monotonic() + 60
        while r0.get("/get_load").json()[0]["num_reqs"] < MAX_PENDING:
            assert time.monotonic() < deadline, "replica 0 never reached its admission limit"
            time.sleep(0.05)
        probe = r0.post("/generate", json={"text": "probe", "sampling_params": {"max_new_tokens": 1}})
        assert probe.status_code == 503 and "overloaded" in probe.text
        through = [replicas.http.post("/generate", headers={"X-SMG-Routing-Key": uuid.uuid4().hex},
                                      json={"text": f"Short question {i}?", "sampling_params": {
                                          "max_new_tokens": 2}}) for i in range(6)]
        assert [r.status_code for r in through] == [200] * 6, [r.text for r in through]
        assert [f.result().status_code for f in direct] == [200] * MAX_PENDING
    after = _served(replicas)
    assert after[0] - before[0] == MAX_PENDING  # only what it was sent directly
    assert after[1] - before[1] == 6


def test_launcher_killed_leaves_no_process_behind(replicas):
    """Even SIGKILL of the launcher (no cleanup code runs) takes its children down: each one gets SIGTERM when
    its parent dies (PR_SET_PDEATHSIG). test_scale.py checks the graceful stop."""
    children = set(replicas.pids) - {replicas.proc.pid}  # the gateway, both replicas and the restarted one
    assert len(children) == 4 and all(alive(p) for p in children - {replicas.info["replicas"][0]["pid"]})
    replicas.proc.kill()
    replicas.proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while [p for p in children if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in children if alive(p)] == []
