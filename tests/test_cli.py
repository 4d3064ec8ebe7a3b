import json
import subprocess
import sys


def lmc(*args):
    return subprocess.run([sys.executable, "-m", "lmc.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_text_and_json():
    r = lmc("generate", "What is the capital of France?", "--chat", "--max-new-tokens", "12", "--json",
            "--dtype", "float32")  # (the CPU's default; a GPU's bf16 answers otherwise)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["meta_info"]["completion_tokens"] <= 12


def test_unknown_model_is_a_clear_error():
    r = lmc("generate", "hi", "--model", "gpt-17")
    assert r.returncode == 2 and "unknown model 'gpt-17'" in r.stderr and "smollm2-135m-instruct" in r.stderr
    assert "Traceback" not in r.stderr


def test_models_lists_known_names():
    r = lmc("models")
    assert r.returncode == 0 and "dummy:llama-2-7b" in r.stdout and "smollm2-135m-instruct" in r.stdout


def test_serve_freezes_its_start_up_heap(tmp_path):
    """`lmc serve` leaves its start-up objects out of the collector's scans (launch.freeze_startup_heap): a full
    collection no longer walks the model and the app, and requests are served as before."""
    import time
    import urllib.request

    from lmc.server.replicas import free_port

    def call(path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"null")

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:  # a file, not a pipe nobody reads while the server runs
        proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", "serve", "--model", "dummy:tiny", "--port",
                                 str(port), "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                call("/health")
                break
            except OSError:
                pass
            assert time.monotonic() < deadline, "lmc serve did not start"
            time.sleep(0.5)
        assert call("/get_server_info")["gc_frozen_objects"] > 10_000
        out = call("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert len(out["output_ids"]) == 2
    finally:
        proc.terminate()
        proc.wait(timeout=60)
