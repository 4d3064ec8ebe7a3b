"""benchmarks/program_timeline.py on the tiny model: each compiled segment's phases add up to its request, and the
engine's steps are the forwards the instance cost."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_program_timeline_accounts_for_each_request(tmp_path):
    out = tmp_path / "timeline.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "program_timeline.py"), "--model",
                    "dummy:tiny@smollm2-135m-instruct", "--programs", "chain6,judge", "--reps", "2", "--out", str(out)],
                   check=True, timeout=300, cwd=tmp_path)
    res = json.loads(out.read_text())
    chain, judge = res["programs"]["chain6"], res["programs"]["judge"]
    assert len(chain["segments"]) == 1 and len(judge["segments"]) == 2  # judge breaks for its host code
    for prog in (chain, judge):
        for seg in prog["segments"]:
            assert all(seg[k]["min"] >= 0 for k in res["phases"])
            assert seg["steps"]["min"] >= 1 and seg["steps_busy"]["median"] > 0
        phases = sum(seg[k]["median"] for seg in prog["segments"] for k in res["phases"])
        assert phases < prog["wall_ms"]["max"]  # the requests are part of the instance's wall time
        # each step launches at most one forward; without overlap (the CPU's default) each launches one
        steps = sum(seg["steps"]["median"] for seg in prog["segments"])
        assert steps >= prog["forwards"]["median"] and (res["overlap"] or steps == prog["forwards"]["median"])
