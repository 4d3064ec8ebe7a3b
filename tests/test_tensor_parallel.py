"""Tensor parallelism on the CPU with gloo (runtime/distributed): the embedded model over 2 ranks (its 9 query and
3 KV heads split unevenly, 6 + 3 and 2 + 1) gives TP=1's greedy tokens and logits; bad sizes are refused with the
reason; overlap scheduling under TP gives the same outputs; a worker that dies fails every pending request and
leaves no process behind."""
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lmc.runtime import Engine
from lmc.runtime.core import EngineError
from lmc.runtime.distributed import TensorParallelError, plan_shards
from lmc.runtime.distributed.workers import rank_devices
from lmc.runtime.model.llama import ModelConfig

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three colors:"]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
KW = dict(max_total_tokens=4096, max_running_requests=8)


def ranks(n: int):
    """A test of an n-rank engine: on the CPU (CI) the ranks are processes; on a GPU machine each takes a GPU."""
    short = torch.cuda.is_available() and torch.cuda.device_count() < n
    return pytest.mark.skipif(short, reason=f"{n} ranks need {n} GPUs on a GPU machine")


class LogitsRecorder:
    """Wraps a runner's real forward and keeps a copy of the logits of every step (the engine's own path runs)."""

    def __init__(self, runner):
        self.logits: list[torch.Tensor] = []
        forward = runner._forward

        def recording(*packed):
            logits, sample_rows = forward(*packed)
            self.logits.append(logits.clone())
            return logits, sample_rows

        runner._forward = recording


def _children() -> list[int]:
    """Pids of this process's live children (from /proc), but multiprocessing's resource tracker (one per
    process, started with the first spawned process and shared by all; it exits with this process)."""
    me, out = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        if fields[1] == me and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def tp1_and_tp2(engine):
    """The same requests through the session's TP=1 engine (its prefix cache flushed, so that it runs the same
    batches) and a TP=2 engine."""
    assert engine.flush_cache()
    rec = LogitsRecorder(engine.runner)
    try:
        results = {1: (engine.generate(PROMPTS, GREEDY), rec.logits)}
    finally:
        del engine.runner._forward
    eng = Engine(MODEL, tensor_parallel_size=2, **KW)
    rec = LogitsRecorder(eng.runner)
    try:
        results[2] = (eng.generate(PROMPTS, GREEDY), rec.logits)
    finally:
        eng.shutdown()
    return results


@ranks(2)
def test_tp2_greedy_tokens_identical_to_tp1(tp1_and_tp2):
    (one, _), (two, _) = tp1_and_tp2[1], tp1_and_tp2[2]
    assert [r["output_ids"] for r in two] == [r["output_ids"] for r in one]
    assert all(len(r["output_ids"]) == GREEDY["max_new_tokens"] for r in one)


@ranks(2)
def test_tp2_logits_within_1e5_relative_of_tp1(tp1_and_tp2):
    (_, l1), (_, l2) = tp1_and_tp2[1], tp1_and_tp2[2]
    assert len(l1) == len(l2) and len(l1) >= GREEDY["max_new_tokens"]  # one prefill and the decodes, each
    # Within 1e-5 relative to the logits' scale (they reach ~34). Not 1e-5 absolute: float32 sums in another order
    # differ by up to ~3e-5 (~1e-5 on average), and TP=1 itself differs by 4.9e-5 between a request alone and in
    # a batch of three. A wrong shard is off by whole units.
    for a, b in zip(l1, l2):
        assert a.shape == b.shape and a.shape[-1] == 49152
        worst, scale = (b - a).abs().max().item(), a.abs().max().item()
        assert worst <= 1e-5 * scale, (worst, scale)


@ranks(2)
def test_tp2_with_overlap_matches_tp1_without():
    """Overlap scheduling under TP=2 (rank 0's broadcasts and forwards on the CPU worker thread): the workers read
    the ids rank 0 sampled from its token buffer. Dummy weights, so that the sampled ids spread over the whole
    vocabulary: an id in rank 1's half of the embedding that rank 1 did not get would change the logits."""
    ids = [[1, 5, 7, 9, 11, 300], [2, 3, 4], [400, 17]]
    params = [GREEDY, {"max_new_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True}, GREEDY]
    with Engine("dummy:tiny", **KW) as one:
        want = one.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    eng = Engine("dummy:tiny", tensor_parallel_size=2, overlap_schedule=True, check_invariants=True, **KW)
    try:
        assert eng.scheduler.overlap
        got = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    finally:
        eng.shutdown()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert any(t >= 256 for w in want for t in w["output_ids"])  # rank 1's vocabulary shard
    for g, w in zip(got, want):
        lp = [[t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in (g, w)]
        assert lp[0] == pytest.approx(lp[1], rel=1e-5)
    assert not _children()


@ranks(2)
def test_no_worker_left_after_shutdown(tp1_and_tp2):
    assert not _children()


def test_shard_plan_splits_kv_groups():
    cfg = ModelConfig(hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
                      intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5, max_position=64,
                      tie_word_embeddings=True, qkv_bias=False, eos_token_ids=(2,))
    two = plan_shards(cfg, 2)
    assert [(p.q0, p.q1, p.k0, p.k1) for p in two] == [(0, 6, 0, 2), (6, 9, 2, 3)]
    assert [(p.i0, p.i1) for p in two] == [(0, 768), (768, 1536)]
    # more ranks than KV heads: a KV head is replicated, its query heads split among its ranks
    four = plan_shards(cfg, 4)
    assert [(p.q0, p.q1, p.k0, p.k1) for p in four] == [(0, 2, 0, 1), (2, 3, 0, 1), (3, 6, 1, 2), (6, 9, 2, 3)]
    odd = plan_shards(cfg.__class__(**{**cfg.__dict__, "vocab_size": 49153}), 2)
    assert [(p.v0, p.v1, p.vocab_shard) for p in odd] == [(0, 24577, 24577), (24577, 49153, 24577)]


@pytest.mark.parametrize("size, reason", [(10, "more than the model's 9 attention heads"),
                                          (0, "positive integer"), ("2", "positive integer")])
def test_bad_tensor_parallel_size_is_refused(size, reason):
    with pytest.raises(TensorParallelError, match=reason):
        Engine(MODEL, tensor_parallel_size=size, **KW)
    assert not _children()


def test_more_ranks_than_gpus_is_refused():
    have = torch.cuda.device_count()
    with pytest.raises(TensorParallelError, match=f"needs {have + 1} GPUs from cuda:0, but {have} GPU"):
        rank_devices(torch.device("cuda"), have + 1)


@pytest.mark.slow
@ranks(4)
def test_tp4_replicates_kv_heads_and_matches_tp1(tp1_and_tp2):
    """4 ranks over 3 KV heads: KV head 0 is on ranks 0 and 1, which split its 3 query heads 2 + 1."""
    eng = Engine(MODEL, tensor_parallel_size=4, **KW)
    try:
        four = eng.generate(PROMPTS, GREEDY)
    finally:
        eng.shutdown()
    assert [r["output_ids"] for r in four] == [r["output_ids"] for r in tp1_and_tp2[1][0]]
    assert not _children()


@ranks(2)
def test_dead_worker_fails_pending_requests_and_leaves_no_process():
    """Also: dummy weights drawn sharded are the unsharded model's (the same greedy tokens and logprobs)."""
    ids = [[1, 5, 7, 9, 11, 300], [2, 3, 4]]
    with Engine("dummy:tiny", **KW) as one:
        ref = one.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    eng = Engine("dummy:tiny", tensor_parallel_size=2, **KW)
    try:
        got = eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        for a, b in zip(ref, got):
            assert a["output_ids"] == b["output_ids"]
            lp = [[t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in (a, b)]
            assert lp[0] == pytest.approx(lp[1], rel=1e-5)
        (worker,) = eng.runner.tp.workers
        futs = [eng.submit(input_ids=[1, 2, 3 + i], sampling_params={"max_new_tokens": 1000, "ignore_eos": True})
                for i in range(3)]
        deadline = time.monotonic() + 60
        while eng.scheduler.stats["decode_forwards"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the requests are decoding: rank 0 is in (or between) broadcasts and collectives
        assert not any(f.done() for f in futs)
        os.kill(worker.process.pid, signal.SIGKILL)
        for f in futs:
            with pytest.raises(EngineError, match="worker rank 1 .* was killed by signal 9"):
                f.result(timeout=60)
        assert not worker.process.is_alive() and not _children()
        with pytest.raises(EngineError, match="killed by signal 9.*restart it"):
            eng.submit(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
    finally:
        eng.shutdown()
    assert not _children()


def test_serve_with_a_bad_tp_is_a_usage_error():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lmc.cli", "serve", "--tp", "10", "--port", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "more than the model's 9 attention heads" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
