"""A pytest plugin for hunting a state leak (`benchmarks/gpu_suite.sh` with GPU_SUITE_DRIFT=1, or
`pytest -p engine_drift` with tests/ on the path): after every test that uses the session engine, its greedy output
for one prompt, by text and by ids, against the CPU's, one line per test appended to $LMC_DRIFT_LOG (xdist workers'
output does not reach the terminal). The first "BAD" line of a worker names the test after which the engine's
results changed. On the GPU under xdist (results/gpu_pytest.json), test_native_generate and the cascade test failed
only after other files had run on their worker. Tests that do not use the engine are not made to build it (that
would change the history being probed)."""
import os

import pytest

PROMPT = "The capital of France is"
WANT = [7042, 30, 198, 198, 504, 2988]  # fp32, greedy, 6 tokens (the CPU's, and a fresh engine's on the GPU)


@pytest.fixture(autouse=True)
def _engine_drift(request):
    yield
    if "engine" not in request.fixturenames:
        return
    eng = request.getfixturevalue("engine")
    params = {"max_new_tokens": 6, "temperature": 0}
    by_text = eng.generate(PROMPT, params)["output_ids"]
    by_ids = eng.generate(input_ids=eng.tokenizer.encode(PROMPT), sampling_params=params)["output_ids"]
    line = (f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {'ok' if by_text == WANT == by_ids else 'BAD'} "
            f"after {request.node.nodeid}: {by_text} / {by_ids}\n")
    with open(os.environ.get("LMC_DRIFT_LOG", "engine_drift.log"), "a") as f:
        f.write(line)
