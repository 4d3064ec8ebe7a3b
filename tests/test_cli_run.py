"""`lmc run` and `lmc run-batch` through subprocesses on the embedded model. Usage errors are found before the
model loads (fast); the five runs that load it use a small KV cache to start quickly."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--temperature", "0", "--max-new-tokens", "8", "--max-total-tokens", "4096"]

TWO_PROGRAMS = '''
import lmc as sgl

@sgl.function
def ok(s, x, n=1):  # `n` is also a sampling option of run(): here an argument
    s += "Q: What is the capital of Japan?\\nA: Tokyo\\nQ: What is the capital of " + x + "?\\nA:"
    s += sgl.gen("answer", max_tokens=4, stop="\\n")

@sgl.function
def boom(s):
    s += "Say something:" + sgl.gen("said", max_tokens=2)
    raise RuntimeError("kaboom after " + repr(s["said"]))

if __name__ == "__main__":
    open({marker!r}, "w").write("the __main__ block ran")
'''

BATCH_PROGRAM = '''
import lmc as sgl

@sgl.function
def capital(s, country, fail=False):
    with open({calls!r}, "a") as f:  # one line per program run: shows what a resumed batch reruns
        f.write(country + "\\n")
    if fail:
        raise ValueError("no capital for " + country)
    s += "Q: What is the capital of Japan?\\nA: Tokyo\\nQ: What is the capital of " + country + "?\\nA:"
    s += sgl.gen("answer", max_tokens=6, stop="\\n")
    s["not_json"] = {{1, 2}}
'''

SLOW_PROGRAM = '''
import time
import lmc as sgl

@sgl.function
def count(s, k):
    with open({calls!r}, "a") as f:  # one line per program run
        f.write(str(k) + "\\n")
    time.sleep(0.3)  # keeps the batch running long enough to be killed in the middle
    s += "Count: " + str(k) + "," + sgl.gen("next", max_tokens=2)
'''


def lmc(*args):
    return subprocess.run([sys.executable, "-m", "lmc.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.fixture
def two(tmp_path):
    marker = tmp_path / "main-ran"
    path = tmp_path / "two.py"
    path.write_text(TWO_PROGRAMS.format(marker=str(marker)))
    return path, marker


def test_run_prints_variables_then_text():
    r = lmc("run", "examples/few_shot_qa.py", "--arg", "question=What is the capital of Germany?", *FAST)
    assert r.returncode == 0, r.stderr
    head, sep, text = r.stdout.partition("--- text ---\n")
    assert sep and json.loads(head.strip().removeprefix("answer = ")).strip() == "Berlin"
    assert "Q: What is the capital of Germany?\nA: Berlin" in text


def test_run_json(two):
    path, marker = two
    r = lmc("run", f"{path}:ok", "--arg", "x=France", "--arg", "n=[1, 2]", "--json", *FAST)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"variables", "text", "messages"}
    assert "Paris" in out["variables"]["answer"] and out["text"].endswith(out["variables"]["answer"])
    assert out["messages"] == []
    assert not marker.exists()  # the file was imported, not run as a script


def test_program_error_is_one_line_exit_1(two):
    path, marker = two
    r = lmc("run", f"{path}:boom", *FAST)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("lmc: boom failed: RuntimeError: kaboom after") and "Traceback" not in r.stderr
    assert f"{path}:12" in r.stderr  # where in the user's file
    assert not marker.exists()


def test_usage_errors_exit_2_before_loading_a_model(two):
    path, _ = two
    r = lmc("run", path)
    assert r.returncode == 2 and "2 programs: ok, boom" in r.stderr and f"{path}:NAME" in r.stderr
    r = lmc("run", f"{path}:ok")
    assert r.returncode == 2 and "missing required argument(s) 'x' for ok" in r.stderr
    r = lmc("run", f"{path}:ok", "--arg", "x=France", "--arg", "z=3")
    assert r.returncode == 2 and "unknown argument(s) 'z' for ok; it takes: x, n=1" in r.stderr
    r = lmc("run", f"{path}:nope")
    assert r.returncode == 2 and "no program 'nope'; programs: ok, boom" in r.stderr
    r = lmc("run", f"{path}:ok", "--arg", "x=France", "--backend", "nosuch")
    assert r.returncode == 2 and "unknown backend 'nosuch'; available backends: local, openai, endpoint" in r.stderr
    r = lmc("run-batch", path, "-i", path.with_suffix(".jsonl"), "-o", path.with_suffix(".out"))
    assert r.returncode == 2 and "2 programs" in r.stderr
    assert all("Traceback" not in x for x in (r.stderr, r.stdout))


def test_run_batch_records_failures_and_resumes(tmp_path):
    calls, prog = tmp_path / "calls.txt", tmp_path / "batch.py"
    prog.write_text(BATCH_PROGRAM.format(calls=str(calls)))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"country": "France"}, {"country": "Atlantis", "fail": True}, "not json", {"country": "Italy"},
             {"nation": "Spain"}]
    inp.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))

    r = lmc("run-batch", prog, "-i", inp, "-o", out, "--num-threads", "2", *FAST)
    assert r.returncode == 1, r.stderr  # some lines failed; the others ran
    assert "capital" in r.stderr and "%|" in r.stderr and "failed=3" in r.stderr  # the progress bar counts them
    assert "2 of 5 line(s) succeeded, 3 failed" in r.stderr
    assert "lmc: first failure, line " in r.stderr  # and the summary names the first one
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in recs] == [0, 1, 2, 3, 4]  # one line per input line, sorted once finished
    assert "Paris" in recs[0]["variables"]["answer"] and "Rome" in recs[3]["variables"]["answer"]
    assert recs[0]["variables"]["not_json"] == "{1, 2}" and recs[0]["text"].endswith(recs[0]["variables"]["answer"])
    assert "ValueError: no capital for Atlantis" in recs[1]["error"]
    assert "malformed input line" in recs[2]["error"]
    assert "unknown argument(s) 'nation'" in recs[4]["error"]
    assert sorted(calls.read_text().split()) == ["Atlantis", "France", "Italy"]
    first = out.read_text().splitlines()

    with open(inp, "a") as f:
        f.write(json.dumps({"country": "Spain"}) + "\n")
    r = lmc("run-batch", prog, "-i", inp, "-o", out, *FAST)
    assert r.returncode == 1 and "2 line(s) already done" in r.stderr, r.stderr
    # Finished lines are not rerun (kept byte for byte), the failed one is retried, the new one is done.
    assert sorted(calls.read_text().split()) == ["Atlantis", "Atlantis", "France", "Italy", "Spain"]
    again = out.read_text().splitlines()
    assert len(again) == 6 and again[0] == first[0] and again[3] == first[3] and again[1:3] == first[1:3]
    assert json.loads(again[5])["index"] == 5 and "Madrid" in json.loads(again[5])["variables"]["answer"]


def _records(out: Path) -> list[dict]:
    text = out.read_text()
    assert text == "" or text.endswith("\n")  # no torn last line
    return [json.loads(x) for x in text.splitlines()]


def test_run_batch_killed_mid_batch_resumes_without_loss_or_duplicates(tmp_path):
    calls, prog = tmp_path / "calls.txt", tmp_path / "slow.py"
    prog.write_text(SLOW_PROGRAM.format(calls=str(calls)))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 12
    inp.write_text("".join(json.dumps({"k": k}) + "\n" for k in range(n)))
    args = ["run-batch", prog, "-i", inp, "-o", out, "--num-threads", "2", *FAST]

    proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and out.read_text().count("\n") >= 4):
            assert proc.poll() is None, "run-batch exited before it could be killed"
            assert time.monotonic() < deadline, "no output lines within 240 s"
            time.sleep(0.05)
        proc.kill()  # SIGKILL: no cleanup, no final rewrite
    finally:
        proc.kill()
        proc.wait(30)
    before = out.read_text()
    kept = [line for line in before.splitlines(keepends=True) if line.endswith("\n")]
    assert 4 <= len(kept) < n, "the kill must land in the middle of the batch"
    survived = {json.loads(line)["index"] for line in kept}
    with open(out, "a") as f:  # what a kill in the middle of a write leaves: a partial line without its newline
        f.write('{"index": %d, "variables": {"ne' % (n - 1))

    r = lmc(*args)
    assert r.returncode == 0, r.stderr
    assert f"{len(survived)} line(s) already done" in r.stderr
    recs = _records(out)
    assert [x["index"] for x in recs] == list(range(n))  # each input line exactly once, in order
    assert all("error" not in x and x["text"].startswith(f"Count: {x['index']},") for x in recs)
    for line in kept:  # finished records are kept byte for byte
        assert line in out.read_text().splitlines(keepends=True)
    runs = [int(x) for x in calls.read_text().split()]
    assert sorted(set(runs)) == list(range(n))
    assert all(runs.count(k) == 1 for k in survived)  # what finished before the kill is not rerun

    # The input changes under a partial (here: finished) output: refused before anything runs, output untouched.
    finished = out.read_text()
    inp.write_text(inp.read_text().replace('{"k": 3}', '{"k": 33}'))
    r = lmc(*args)
    assert r.returncode == 2 and "changed since" in r.stderr and str(inp) in r.stderr, r.stderr
    assert out.read_text() == finished and runs == [int(x) for x in calls.read_text().split()]
    # An output without the record of its input is refused too: it could come from any input.
    (tmp_path / "out.jsonl.input.json").unlink()
    r = lmc(*args)
    assert r.returncode == 2 and "out.jsonl.input.json" in r.stderr and "start over" in r.stderr, r.stderr
