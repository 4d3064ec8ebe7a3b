"""SGLang's own serving benchmark client (`sglang.bench_serving`, 0.5.10, `--backend sglang`: native `/generate`)
run as a subprocess against `lmc serve` on loopback, streamed (its default) and with `--disable-stream`, on its
synthetic `generated-shared-prefix` workload (groups of prompts sharing a system prompt; the `random` and ShareGPT
workloads download a dataset). The tokenizer is the embedded model's local directory; nothing reaches a hub.
0.5.10's client has no `--cache-report`; 0.5.23's has, but it imports SGLang's GPU server stack (torch.distributed,
model configs, via `sglang.srt.disaggregation.utils`) for one constant, which the project does not install.

Every request must complete with no error, and the client's token counts must be consistent with what was asked."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL

pytest.importorskip("sglang", reason="SGLang is not installed (`make setup` installs it)")
pytest.importorskip("datasets", reason="SGLang's benchmark client needs `datasets` (the sglang-frontend extra)")

LAUNCHER = Path(__file__).with_name("sglang_bench_client.py")
GROUPS, PROMPTS_PER_GROUP, OUTPUT_LEN = 2, 2, 4


def run_client(server, tmp_path: Path, *extra: str) -> dict:
    """One run of the client; returns its JSON result (the last line it appends to --output-file)."""
    from lmc.runtime.model.loader import resolve

    model_dir = str(resolve(MODEL).tokenizer_dir)
    out = tmp_path / "result.jsonl"
    # HOME in tmp_path: the workload generator caches its prompts under ~/.cache/sglang.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": API_KEY, "HOME": str(tmp_path)}
    cmd = [sys.executable, str(LAUNCHER), "--backend", "sglang", "--base-url", server.url,
           "--model", model_dir, "--tokenizer", model_dir,
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(GROUPS),
           "--gsp-prompts-per-group", str(PROMPTS_PER_GROUP), "--gsp-system-prompt-len", "32",
           "--gsp-question-len", "8", "--gsp-output-len", str(OUTPUT_LEN),
           "--num-prompts", str(GROUPS * PROMPTS_PER_GROUP),
           "--warmup-requests", "1", "--disable-tqdm", "--output-details", "--output-file", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text().splitlines()[-1])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "disable-stream"])
def test_sglang_bench_client_completes_every_request(server, tmp_path, stream):
    result = run_client(server, tmp_path, *([] if stream else ["--disable-stream"]))
    n = GROUPS * PROMPTS_PER_GROUP
    assert result["backend"] == "sglang"
    assert result["completed"] == n, result["errors"]
    assert result["errors"] == [""] * n
    # The workload ignores EOS by default, so each request generates exactly its output length.
    assert result["output_lens"] == [OUTPUT_LEN] * n
    assert result["total_output_tokens"] == n * OUTPUT_LEN
    assert all(t > 0 for t in result["input_lens"])
    assert all(text for text in result["generated_texts"])
    if stream:  # time to first token and inter-token latency come from the streamed chunks
        assert all(0 < ttft for ttft in result["ttfts"])
        # The client counts inter-token latencies from its first chunk with text on, one per new token: a first
        # token whose text the server holds back (an incomplete character) arrives with the second, and that
        # request has one fewer.
        assert all(OUTPUT_LEN - 2 <= len(itl) <= OUTPUT_LEN - 1 for itl in result["itls"])
