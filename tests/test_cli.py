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
