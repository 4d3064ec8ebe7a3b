"""The workload suite (benchmarks/suite): the optimum of Theorem 3.1 on hand-counted request sets; one workload
through `run.py --quick` end to end (JSON shape, hit rate never above its optimum, the report section and the
pictures); every workload's programs build from the shipped data."""
import json
import sys
from pathlib import Path

import pytest

import lmc

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "suite"
sys.path.insert(0, str(SUITE))

from optimal import Request, optimum  # noqa: E402


def test_optimum_counts_each_distinct_prefix_once():
    # [1,2,3,4] then [1,2,3,5]: 4 + 1 new tokens, and the second's last token (its logits) is new anyway
    assert optimum([Request([1, 2, 3, 4]), Request([1, 2, 3, 5])]).min_computed == 5
    # a prompt entirely cached still computes its last token
    assert optimum([Request([1, 2, 3]), Request([1, 2, 3])]).min_computed == 4
    # prompt logprobs from position 1: positions 1..3 are recomputed although cached
    assert optimum([Request([1, 2, 3, 4]), Request([1, 2, 3, 4], logits_from=1)]).min_computed == 7


def test_optimum_credits_generated_tokens():
    """Turn 2 of a chat extends turn 1's prompt and output: the output (all but its last token) is cached."""
    opt = optimum([Request([1, 2], output=[7, 8, 9]), Request([1, 2, 7, 8, 9, 4])])
    assert opt.prompt_tokens == 8
    assert opt.min_computed == 2 + 2  # turn 1's prompt; turn 2: token 9 (never forwarded) and 4
    assert opt.hit_rate == pytest.approx(0.5)


def test_every_workload_builds_from_the_shipped_data():
    from workloads import BUILDERS, build

    for name in BUILDERS:
        w = build(name, "quick")
        assert w.calls and w.sharing and 1 <= w.latency_calls <= len(w.calls), name
    assert sum(f.stat().st_size for f in (SUITE / "data").glob("*.json")) < 400_000


def test_every_named_size_covers_every_workload_within_the_data():
    from workloads import BUILDERS, SIZES, build

    for size, counts in SIZES.items():
        assert set(counts) == set(BUILDERS), size
    for size in ("recorded", "large"):
        for name, n in SIZES[size].items():
            assert len(build(name, size).calls) == n, (size, name)  # the data holds the recorded batches
    assert len(build("rag", "quick", n=5).calls) == 5
    with pytest.raises(ValueError, match="at least one program"):
        build("rag", n=0)
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        build("rag", "huge")


def test_programs_option_names_the_bad_item():
    import run

    assert run._programs("mmlu=12,rag=3") == {"mmlu": 12, "rag": 3}
    with pytest.raises(SystemExit, match="'nope=3'"):
        run._programs("mmlu=2,nope=3")
    with pytest.raises(SystemExit, match="'rag=x'"):
        run._programs("rag=x")


def _suite_report():
    import importlib.util

    # By path: `report` is also benchmarks/report.py's module name (tests/test_records.py imports that one).
    spec = importlib.util.spec_from_file_location("suite_report", SUITE / "report.py")
    suite_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_report)
    return suite_report


def test_report_lists_the_variables_that_differ():
    diff = {"program": 1, "lmc": json.dumps({"a": "x", "b": [1, 2]}), "vllm": json.dumps({"a": "x|y", "b": [1, 2]})}
    results = {"json_decode": {"lmc": {"runs": [{"first_difference": None}]},
                               "vllm": {"runs": [{"first_difference": diff}, {"first_difference": None}]}}}
    rows = _suite_report()._differences(results, ["lmc", "vllm"])
    assert rows[-1] == '| json_decode | vllm | 1 | `a` | `"x"` | `"x\\|y"` |'  # only `a`; the pipe escaped
    assert len([r for r in rows if r.startswith("| json_decode")]) == 1


@lmc.function
def chained(s, topic):
    """A chain of every kind of call: a gen, a multi-token select (scored by child requests), a single-token
    select, a gen after it."""
    s += "Topic: " + topic + "\nFact:" + lmc.gen("fact", max_tokens=6, stop="\n")
    s += "\nIs it true? " + lmc.select("true", choices=["yes indeed", "no way"])
    s += "\nI rate it " + lmc.select("score", choices=["1", "2", "3"])
    s += " out of 3.\nIn one word:" + lmc.gen("word", max_tokens=3)


def test_engine_recorder_counts_a_chain_call_by_call(engine):
    """With engine-side continuation, a compiled chain is one Req reset between its calls: the recorder sees each
    call (a select's choices' children included) with its own prompt and cached tokens, which are the engine's
    own per-call figures; the optimum holds above them, and call by call it is what the engine reached."""
    from measure import EngineRecorder

    assert engine.enable_continuation  # the engine's default, which the suite measures
    be = lmc.Local(engine=engine)
    compiled = chained.compile()
    figures = {}
    for continuation in (False, True):
        engine.enable_continuation = continuation
        try:
            assert engine.flush_cache()
            with EngineRecorder(engine) as rec:
                st = compiled.run(topic="the moon", backend=be, temperature=0)
            assert st.error() is None
            figures[continuation] = rec.figures(), rec.calls, st
        finally:
            engine.enable_continuation = True
    fig, calls, st = figures[True]
    assert fig.calls["engine_calls"] == len(calls) == 1 + 2 + 1 + 1  # gen, 2 choice children, select, gen
    word = st.get_meta_info("word")
    assert calls[-1].cached_tokens == word["cached_tokens"] > 0  # the last gen kept the chain's KV
    assert len(calls[-1].request.prompt) == word["prompt_tokens"]
    assert fig.hit_rate <= fig.optimal.hit_rate + 1e-9
    assert fig.hit_rate >= 0.97 * fig.optimal.hit_rate
    off, _, st_off = figures[False]
    assert st_off.variables() == st.variables()
    assert fig.prompt_tokens == off.prompt_tokens  # the same calls, with the same prompts, as call by call


def test_quick_run_of_one_workload(tmp_path):
    import run

    render = _suite_report().render

    path = tmp_path / "suite.json"
    results = run.main(["--quick", "--workloads", "generative_agents", "--json", str(path), "--no-ablation"])
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    f = results["generative_agents"]["lmc"]
    for key in ("programs_per_s", "latency_s", "hit_rate", "optimal_hit_rate"):
        assert f[key] > 0 and f[f"{key}_min"] <= f[key] <= f[f"{key}_max"], key
    assert f["errors"] == 0 and f["equal_outputs_vs_lmc"] == 1.0
    assert f["hit_rate"] <= f["optimal_hit_rate"] + 1e-9  # no engine beats the optimum
    assert f["optimal_hit_rate"] > 0.2  # one call per function: the five share the world description
    assert results["_meta"]["size"] == "quick" and results["_meta"]["workloads"]["generative_agents"]["programs"] == 5
    assert results["_meta"]["load_average_before"] and results["_meta"]["workloads"]["generative_agents"]["sharing"]
    md = render(results, tmp_path)
    assert "| generative_agents |" in md and "achieved / optimal" in md
    assert (tmp_path / "suite_throughput.png").stat().st_size > 0 and "suite_throughput.png" in md


def test_peer_cpu_binding_is_read_from_the_vllm_log(tmp_path):
    from peer import cpu_binding

    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) INFO [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
                   "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto', "
                   "auto_setup=True, skip_setup=False\n"
                   "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n"
                   "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \treserved_cpus=[1]\n")
    assert cpu_binding(str(log)) == {"VLLM_CPU_OMP_THREADS_BIND": "auto", "compute_cores": [0],
                                     "reserved_cores": [1], "log": str(log)}
    log.write_text("no binding block here\n")
    assert cpu_binding(str(log)) is None
    assert cpu_binding(str(tmp_path / "missing.log")) is None


def test_peer_wait_quiet_waits_out_a_process_tree_that_polls_after_its_work():
    """As vLLM's worker after its last step: a child that spins for a while, then sleeps. wait_quiet returns only
    once the tree is idle, and at once for an idle tree."""
    import subprocess
    import time

    from peer import process_tree, wait_quiet

    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import time\\nt = time.time()\\nwhile time.time() - t < 0.8: pass\\ntime.sleep(60)'])\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.perf_counter()
        waited = wait_quiet(process_tree(parent.pid), timeout=20)
        assert waited >= 0.4 and time.perf_counter() - t0 >= 0.4  # the child's spin was waited out
        assert wait_quiet(process_tree(parent.pid), timeout=5) < 0.5  # idle now: one window
        with pytest.raises(RuntimeError, match="still used the CPU"):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                wait_quiet(process_tree(spinner.pid), timeout=0.5, what="the spinner")
            finally:
                spinner.kill()
    finally:
        for p in process_tree(parent.pid)[::-1]:
            p.kill()
        parent.wait()
