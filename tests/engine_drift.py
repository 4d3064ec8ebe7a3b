"""A pytest plugin for hunting a state leak (`benchmarks/gpu_suite.sh` with GPU_SUITE_DRIFT=1, or
`pytest -p engine_drift` with tests/ on the path): after every test that uses the session engine, its greedy output
for one prompt, by text and by ids, against the CPU's, one line per test appended to $LMC_DRIFT_LOG (xdist workers'
output does not reach the terminal), with what the scheduler counted meanwhile (failed forwards, aborts), each
probe's cached prompt tokens and the CUDA graphs captured so far. The first "BAD" line of a worker names the test
after which the engine's results changed. On the GPU under xdist (results/gpu_pytest.json), test_native_generate
and the cascade test failed only after other files had run on their worker. Tests that do not use the engine are
not made to build it (that would change the history being probed).

$LMC_DRIFT_ENGINE: JSON of Engine keyword defaults for the A/B of a suspect (`{"overlap_schedule": false}`)."""
import json
import os

import pytest

PROMPT = "The capital of France is"
WANT = [7042, 30, 198, 198, 504, 2988]  # fp32, greedy, 6 tokens (the CPU's, and a fresh engine's on the GPU)
COUNTS = ("failed_forwards", "aborted", "forwards")


def pytest_configure(config):
    kw = json.loads(os.environ.get("LMC_DRIFT_ENGINE", "{}"))
    if kw:
        from lmc.runtime import engine

        engine.Engine.__init__.__kwdefaults__.update(kw)


def _counts(eng) -> dict:
    stats = eng.scheduler.stats
    g = eng.scheduler.runner.graphs
    graphs = {} if g is None else {"cascade": sorted(g.cascade), "extend": sorted(g.extend)}
    return {**{k: stats.get(k, 0) for k in COUNTS}, **graphs}


@pytest.fixture(autouse=True)
def _engine_drift(request):
    before = _counts(request.getfixturevalue("engine")) if "engine" in request.fixturenames else None
    yield
    if before is None:
        return
    eng = request.getfixturevalue("engine")
    during = {k: v - before[k] if k in COUNTS else v for k, v in _counts(eng).items()}
    params = {"max_new_tokens": 6, "temperature": 0}
    by_text = eng.generate(PROMPT, params)
    by_ids = eng.generate(input_ids=eng.tokenizer.encode(PROMPT), sampling_params=params)
    probed = {k: v for k, v in _counts(eng).items() if k not in COUNTS and v != during[k]}
    a, b = by_text["output_ids"], by_ids["output_ids"]
    cached = [r["meta_info"].get("cached_tokens") for r in (by_text, by_ids)]
    line = (f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {'ok' if a == WANT == b else 'BAD'} "
            f"after {request.node.nodeid}: {a} / {b} cached {cached} during {during}"
            f"{f' graphs captured by the probes {probed}' if probed else ''}\n")
    with open(os.environ.get("LMC_DRIFT_LOG", "engine_drift.log"), "a") as f:
        f.write(line)
