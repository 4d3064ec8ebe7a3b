"""Tensor parallelism on two GPUs (issue 16; the nvidia-h200-x2 machine, NCCL, NVLink multicast left off).

Parts (--parts, all by default), each recorded into one JSON:
- logits:  a llama-2-7b-shaped model (transformers' random init, bf16, the SmolLM2 tokenizer) is written once as a
           safetensors directory, so every system loads the same checkpoint (lmc's ranks read their slices of it).
           Prompt logits of lmc TP=2 (bf16) against lmc TP=1 (bf16), set against transformers' own bf16 noise
           (transformers bf16 against transformers fp32 on the same weights). Deterministic: one run.
- decode:  decode step time at batch 1, 32 and 256, TP=1 and TP=2 alternating within each run, against the floor:
           one GPU's share of the weight bytes at the measured device-copy bandwidth, plus the step's all-reduces
           and logits all-gather timed alone in a separate 2-process NCCL job (same shapes, same count).
- fewshot: the 5-shot MMLU programs (benchmarks/suite: 4 subjects x 24 questions, compiled run_batch, temperature 0)
           in programs/s, TP=1 and TP=2 alternating, prefix cache flushed before each run.
- big:     a llama-2-70b-shaped model (dummy weights; 138 GB in bf16: no single H200 holds it with a KV pool) at
           TP=2: its batch-1 decode step against its two-GPU floor, and the few-shot programs served.
Targets (issue 16): 7B batch-1 step at TP=2 <= 0.65 x TP=1; 70B batch-1 step <= 1.5 x its two-GPU floor.

    flock /tmp/lmc-bench.lock python benchmarks/tp_bench.py [--runs 3] [--out benchmarks/results/tp_h200.json]
    python benchmarks/tp_bench.py --device cpu --shape tiny --big-shape tiny --batches 1,4 --runs 1 --out /tmp/t.json
                                                                   # the CPU smoke run of the script itself (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "suite"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device notes)

from record import finish, provenance, spread  # noqa: E402

TOKENIZER = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def quicksort(xs):\n    ", "Photosynthesis converts light into",
           "In 1848, revolutions spread across"]


def engine(model: str, tp: int, args, **kw):
    from lmc.runtime import Engine

    return Engine(model, device=args.device, tensor_parallel_size=tp, max_total_tokens=args.kv_tokens,
                  cuda_graph_max_bs=args.cuda_graph_max_bs,
                  max_running_requests=max(args.batches) + 2, **kw)  # the whole largest batch in one prefill


# ---- the 7B checkpoint ----------------------------------------------------------------------------------------
def write_checkpoint(shape: str, out: Path, device: str) -> Path:
    """transformers' LlamaForCausalLM of the dummy `shape` with the SmolLM2 tokenizer, its own random init
    (seeded), saved in bf16 as safetensors. Written once; reused when present."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lmc.runtime.model.loader import DUMMY_SHAPES, resolve

    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(resolve(TOKENIZER).tokenizer_dir)
    cfg = LlamaConfig(**{**DUMMY_SHAPES[shape], "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                         "eos_token_id": tok.eos_token_id})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    del model
    return out


# ---- logits ---------------------------------------------------------------------------------------------------
class LogitsRecorder:
    """Keeps the logits rank 0's runner._forward returns (the engine's own forward runs)."""

    def __init__(self, runner):
        self.logits, forward = [], runner._forward

        def recording(*packed):
            logits, sample_rows = forward(*packed)
            self.logits.append(logits.float().cpu())
            return logits, sample_rows

        runner._forward = recording


def lmc_prompt_logits(model: str, tp: int, args) -> list:
    """Per prompt: logits at every prompt position (prompt logprobs from position 0 make the prefill return them)."""
    import torch

    eng = engine(model, tp, args)
    try:
        rec = LogitsRecorder(eng.runner)
        out = []
        for p in PROMPTS:  # one at a time: one prefill each, rows in position order
            rec.logits.clear()
            eng.generate(p, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0)
            first = rec.logits[0]  # the sampled (last) position's row, then positions 0 .. n-2 (runner.Launch)
            out.append(torch.cat([first[1:], first[:1]]))
        return out
    finally:
        eng.shutdown()


def hf_prompt_logits(model: str, dtype, device: str) -> list:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    try:
        with torch.no_grad():
            return [hf(torch.tensor([tok.encode(p)], device=device)).logits[0].float().cpu() for p in PROMPTS]
    finally:
        del hf
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def compare(a: list, b: list) -> dict:
    diffs = [(x - y).abs() for x, y in zip(a, b)]
    return {"max_abs": max(d.max().item() for d in diffs), "mean_abs": statistics.mean(d.mean().item() for d in diffs),
            "argmax_agree": sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b)),
            "positions": sum(len(x) for x in a)}


def part_logits(model: str, args) -> dict:
    import torch

    hf32 = hf_prompt_logits(model, torch.float32, "cuda:0" if args.device == "cuda" else "cpu")
    hf16 = hf_prompt_logits(model, torch.bfloat16, "cuda:0" if args.device == "cuda" else "cpu")
    tp1, tp2 = lmc_prompt_logits(model, 1, args), lmc_prompt_logits(model, 2, args)
    out = {"tp2_vs_tp1": compare(tp2, tp1), "transformers_bf16_vs_fp32": compare(hf16, hf32),
           "tp1_vs_transformers_fp32": compare(tp1, hf32), "tp2_vs_transformers_fp32": compare(tp2, hf32)}
    out["tp2_within_bf16_noise"] = out["tp2_vs_tp1"]["max_abs"] <= out["transformers_bf16_vs_fp32"]["max_abs"]
    return out


# ---- decode step time -----------------------------------------------------------------------------------------
def decode_step_s(eng, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Mean wall time of the scheduler's decode steps while `batch` requests decode together: timed from decode
    step 8 to 8 + new_tokens / 2, well inside the run (all admitted in one prefill, none finished yet)."""
    import random

    rng = random.Random(batch)
    vocab = eng.vocab_size
    stats = eng.scheduler.stats
    base = stats["decode_forwards"]
    futs = [eng.submit(input_ids=[rng.randrange(100, vocab) for _ in range(prompt_len)],
                       sampling_params={"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0})
            for _ in range(batch)]
    lo, hi = base + 8, base + 8 + new_tokens // 2
    while stats["decode_forwards"] < lo:
        time.sleep(0.0005)
    t0, n0 = time.perf_counter(), stats["decode_forwards"]
    while stats["decode_forwards"] < hi:
        time.sleep(0.0005)
    t1, n1 = time.perf_counter(), stats["decode_forwards"]
    for f in futs:
        f.result()
    return (t1 - t0) / (n1 - n0)


def _collective_probe(rank: int, world: int, port: int, shapes: dict, result) -> None:
    """One rank of the all-reduce timing job: every decode-step collective of the model at each batch size."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank, world_size=world)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    out = {}
    for batch, (hidden, reduces, vocab_shard, dtype) in shapes.items():
        x = torch.zeros(batch, hidden, dtype=getattr(torch, dtype), device=dev)
        logits = torch.zeros(batch, vocab_shard, dtype=torch.float32, device=dev)
        gathered = torch.empty(world * batch, vocab_shard, dtype=torch.float32, device=dev)

        def step():
            for _ in range(reduces):
                dist.all_reduce(x)
            all_gather(gathered, logits)

        for _ in range(3):
            step()
        times = []
        for _ in range(10):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        out[batch] = statistics.median(times)
    if rank == 0:
        result.put(out)
    dist.destroy_process_group()


def collective_seconds(cfg, batches: list[int], dtype: str) -> dict:
    """Median time of one decode step's collectives (2 all-reduces per layer + the embedding's, and the logits'
    all-gather) at each batch size, over 2 ranks, timed with nothing else running."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the probe's own store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shapes = {b: (cfg.hidden_size, 2 * cfg.num_layers + 1, -(-cfg.vocab_size // 2), dtype) for b in batches}
    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    procs = [ctx.Process(target=_collective_probe, args=(r, 2, port, shapes, result)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return result.get()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy of 2 GiB (read + write counted), the best of 5: the weight-read floor's
    bandwidth."""
    import torch

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        if a.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if a.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def weight_bytes(eng) -> int:
    """Rank 0's weight bytes (its shard under TP; the ranks' shards differ by a head at most)."""
    return sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())


def model_bytes(cfg, dtype) -> int:
    """The unsharded model's weight bytes (counted on the meta device)."""
    import torch

    from lmc.runtime.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        whole = LlamaForCausalLM(cfg)
    return sum(p.numel() for p in whole.parameters()) * torch.tensor([], dtype=dtype).element_size()


def part_decode(model: str, args, bandwidth: float, collectives: dict) -> dict:
    engines = {tp: engine(model, tp, args) for tp in (1, 2)}  # a TP=1 engine uses no process group
    try:
        steps = {tp: {b: [] for b in args.batches} for tp in engines}
        for _ in range(args.runs):
            for b in args.batches:
                for tp, eng in engines.items():  # alternating within each run
                    steps[tp][b].append(decode_step_s(eng, b, args.prompt_len, args.decode_tokens))
        out = {}
        for tp, eng in engines.items():
            wb = weight_bytes(eng)
            floor = {b: wb / bandwidth + (collectives[b] if tp > 1 else 0.0) for b in args.batches}
            out[f"tp{tp}"] = {"weight_bytes_per_gpu": wb, "step_s": {b: spread(steps[tp][b]) for b in args.batches},
                              "floor_s": floor}
        b1 = min(args.batches)
        ratio = out["tp2"]["step_s"][b1]["median"] / out["tp1"]["step_s"][b1]["median"]
        out["batch1_tp2_over_tp1"] = ratio
        out["target_batch1_tp2_over_tp1_le_0_65"] = ratio <= 0.65
        return out, engines
    except BaseException:
        for eng in engines.values():
            eng.shutdown()
        raise


# ---- few-shot programs ------------------------------------------------------------------------------------------
def fewshot_calls():
    from workloads import _mmlu_item, data, mmlu_question

    calls = []
    for sub in data("mmlu")["subjects"]:
        examples = (f"The following are multiple choice questions (with answers) about {sub['subject']}.\n\n"
                    + "".join(_mmlu_item(e, e["answer"]) + "\n\n" for e in sub["examples"]))
        calls += [{"examples": examples, "question": _mmlu_item(q)} for q in sub["questions"]]
    return mmlu_question, calls


def fewshot_programs_s(eng) -> tuple[float, list]:
    import lmc

    prog, calls = fewshot_calls()
    backend = lmc.Local(engine=eng)
    assert eng.flush_cache(), "the engine was not idle"
    compiled = prog.compile()
    t0 = time.perf_counter()
    states = compiled.run_batch(calls, backend=backend, temperature=0)
    seconds = time.perf_counter() - t0
    return len(calls) / seconds, [s.variables().get("answer") if s.error() is None else "<error>" for s in states]


def part_fewshot(engines: dict, runs: int) -> dict:
    rates = {tp: [] for tp in engines}
    answers = {}
    for _ in range(runs):
        for tp, eng in engines.items():
            rate, answers[tp] = fewshot_programs_s(eng)
            rates[tp].append(rate)
    return {"programs": len(answers[1]), **{f"tp{tp}_programs_s": spread(r) for tp, r in rates.items()},
            "answers_agree": sum(a == b for a, b in zip(answers[1], answers[2]))}


# ---- the 70B shape ---------------------------------------------------------------------------------------------
def part_big(args, bandwidth: float) -> dict:
    from lmc.runtime.model.llama import ModelConfig
    from lmc.runtime.model.loader import resolve

    model = f"dummy:{args.big_shape}@{TOKENIZER}"
    cfg = ModelConfig.from_hf(resolve(model).hf_config)
    collectives = collective_seconds(cfg, [1], args.dtype_name)
    eng = engine(model, 2, args)
    try:
        steps = [decode_step_s(eng, 1, args.prompt_len, args.decode_tokens) for _ in range(args.runs)]
        wb = weight_bytes(eng)
        floor = wb / bandwidth + collectives[1]
        rates = [fewshot_programs_s(eng)[0] for _ in range(args.runs)]
        step = spread(steps)
        return {"model": model, "weight_bytes_per_gpu": wb, "whole_model_bytes": model_bytes(cfg, eng.runner.dtype),
                "batch1_step_s": step, "floor_s": floor, "batch1_over_floor": step["median"] / floor,
                "target_batch1_le_1_5x_floor": step["median"] / floor <= 1.5,
                "fewshot_programs_s": spread(rates)}
    finally:
        eng.shutdown()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="llama-2-7b", help="dummy shape of the written checkpoint")
    ap.add_argument("--big-shape", default="llama-2-70b")
    ap.add_argument("--checkpoint-dir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--parts", default="logits,decode,fewshot,big")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV pool per engine (default: 65536 on CUDA)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256,
                    help="0: no CUDA graphs (NCCL collectives captured in graphs are untested on this code)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "tp_h200.json"))
    args = ap.parse_args(argv)
    import torch

    args.batches = [int(b) for b in args.batches.split(",")]
    args.kv_tokens = args.kv_tokens or (65536 if args.device == "cuda" else 4096)
    args.dtype_name = "bfloat16" if args.device == "cuda" else "float32"
    parts = set(args.parts.split(","))
    prov = provenance("benchmarks/tp_bench.py", note="NCCL_NVLS_ENABLE=0; systems alternate within each run; "
                      f"cuda_graph_max_bs={args.cuda_graph_max_bs}")
    result = {"_meta": {**prov, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                        "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None}}
    ckpt_root = Path(args.checkpoint_dir or tempfile.gettempdir())
    ckpt_root.mkdir(parents=True, exist_ok=True)
    model = str(write_checkpoint(args.shape, ckpt_root / f"lmc-tp-{args.shape}", args.device))
    dev0 = "cuda:0" if args.device == "cuda" else "cpu"
    bandwidth = copy_bandwidth(dev0)
    result["copy_bandwidth_bytes_s"] = bandwidth
    if "logits" in parts:
        result["logits"] = part_logits(model, args)
    if {"decode", "fewshot"} & parts:
        from lmc.runtime.model.llama import ModelConfig
        from lmc.runtime.model.loader import resolve

        collectives = collective_seconds(ModelConfig.from_hf(resolve(model).hf_config), args.batches,
                                         args.dtype_name)
        result["collectives_step_s"] = collectives
        decode, engines = part_decode(model, args, bandwidth, collectives)
        try:
            if "decode" in parts:
                result["decode"] = decode
            if "fewshot" in parts:
                result["fewshot"] = part_fewshot(engines, args.runs)
        finally:
            for eng in engines.values():
                eng.shutdown()
    if "big" in parts:
        result["big"] = part_big(args, bandwidth)
    finish(result["_meta"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
