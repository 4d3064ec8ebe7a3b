"""benchmarks/program_steps.py on the tiny model: each instance's forwards are its steps' (one each on the CPU,
without overlap), split into decode steps and extends, and the steps fit in the instance's wall time."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_program_steps_accounts_for_each_forward(tmp_path):
    out = tmp_path / "steps.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "program_steps.py"), str(out), "chain6", "2"],
                   check=True, timeout=300, cwd=ROOT, env={**os.environ, "M": "dummy:tiny@smollm2-135m-instruct",
                                                    "CUDA_VISIBLE_DEVICES": ""})  # the CPU's accounting
    chain = json.loads(out.read_text())["programs"]["chain6"]
    for way in ("compiled", "interpreted"):
        run = chain[way]["example_run"]
        assert run["decode_forwards"] + run["extend_forwards"] == run["steps"] > 0
        assert len(run["forward_host_ms_extend"]) == len(run["extend_tokens"]) == run["extend_forwards"]
        assert all(t >= 1 for t in run["extend_tokens"])
        assert 0 < run["step_ms"] < run["wall"] and run["forward_host_ms"] < run["step_ms"]
    # the engine chain makes fewer forwards than a request per call (a chain step's text rides on its next call)
    assert chain["compiled"]["steps"] < chain["interpreted"]["steps"]
