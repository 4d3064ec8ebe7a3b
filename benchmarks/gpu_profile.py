"""Where a decode step's time goes on the GPU: torch.profiler around Engine.generate for a dummy-shaped model,
with the paths the step took (fused kernels, CUDA-graph replays, overlap scheduling) checked by counting calls.

Per batch size it reports wall ms/step without the profiler (overlap on and off), and from one profiled run:
GPU kernel time per step, the GPU's busy share of the decode window (the union of kernel intervals over the
window: what the host leaves idle), launches per step, the top kernels and the top host ops by self time. It also
checks that overlap on and off give the same greedy tokens.

    python benchmarks/gpu_profile.py --shape llama-2-7b --batches 1,64 --out profile.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_check import build, sync, time_call  # noqa: E402

import lmc.runtime.kernels as kernels  # noqa: E402
from lmc.runtime import cuda_graph  # noqa: E402


def count_calls(targets: list[tuple[object, str]]):
    """Wrap each (owner, attribute) callable to count its calls; returns (counter, undo)."""
    counts, saved = Counter(), []
    for owner, name in targets:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        def wrapped(*a, _fn=fn, _key=f"{getattr(owner, '__name__', type(owner).__name__)}.{name}", **kw):
            counts[_key] += 1
            return _fn(*a, **kw)
        setattr(owner, name, wrapped)

    def undo():
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return counts, undo


def gen(eng, ids, n):
    return eng.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})


def busy_share(events, t0, t1) -> float:
    """Union of [start, end) of the kernel intervals within [t0, t1), over t1 - t0."""
    spans = sorted((max(s, t0), min(e, t1)) for s, e in events if e > t0 and s < t1)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / (t1 - t0)


@torch.inference_mode()
def profile_batch(eng, cfg, dev, batch, prompt_len, steps) -> dict:
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), generator=g).tolist()
    out = {"batch": batch, "prompt_tokens": prompt_len, "steps": steps}
    for overlap in (True, False):
        eng.scheduler.overlap = overlap
        gen(eng, ids, steps + 1)  # warm-up
        ms = []
        for _ in range(3):
            eng.flush_cache()
            t_full = time_call(lambda: gen(eng, ids, steps + 1), dev)
            eng.flush_cache()
            t_one = time_call(lambda: gen(eng, ids, 1), dev)
            ms.append((t_full - t_one) / steps * 1e3)
        out[f"wall_ms_per_step_overlap_{'on' if overlap else 'off'}"] = sorted(ms)
        eng.flush_cache()
        out[f"tokens_overlap_{'on' if overlap else 'off'}"] = [r["output_ids"] for r in gen(eng, ids[:8], 24)]
    out["greedy_tokens_equal_overlap_on_off"] = out.pop("tokens_overlap_on") == out.pop("tokens_overlap_off")
    eng.scheduler.overlap = True

    counts, undo = count_calls([(cuda_graph.DecodeGraphs, "replay"), (kernels, "add_rms_norm"),
                                (kernels, "rope_q_write_kv"), (kernels, "silu_mul"), (kernels, "rms_norm")])
    try:
        eng.flush_cache()
        gen(eng, ids, steps + 1)
    finally:
        undo()
    out["calls_during_generate"] = dict(counts)  # kernels.* counted at capture only when graphs replay

    def prof_run(n):
        eng.flush_cache()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen(eng, ids, n)
            sync(dev)
        return prof

    prof = prof_run(steps + 1)
    evs = prof.events()
    kern_named = [(e.time_range.start, e.time_range.end, e.name) for e in evs if str(e.device_type).endswith("CUDA")]
    # The decode window: from the prefill's last attention kernel to the last kernel.
    kern_named.sort()
    if not kern_named:  # the CPU smoke run: no device kernels
        kern_named = [(0, 1, "none")]
    ext = [e for s, e, n in kern_named if "_extend_kernel" in n]
    t0 = max(ext) if ext else kern_named[0][0]
    t1 = kern_named[-1][1]
    dec = [(s, e, n) for s, e, n in kern_named if s >= t0]
    per = Counter()
    cnt = Counter()
    for s, e, n in dec:
        per[n] += e - s
        cnt[n] += 1
    out["profiled_window_ms_per_step"] = (t1 - t0) / 1e3 / steps
    out["gpu_kernel_ms_per_step"] = sum(per.values()) / 1e3 / steps
    out["gpu_busy_share_of_window"] = busy_share([(s, e) for s, e, _ in dec], t0, t1)
    out["launches_per_step"] = sum(cnt.values()) / steps
    out["idle_gaps"] = idle_gaps(dec, t0)
    out["step_boundary"] = step_boundary(dec)
    out["top_kernels"] = [{"name": n[:110], "ms_per_step": t / 1e3 / steps, "per_step": cnt[n] / steps}
                          for n, t in per.most_common(18)]
    host = Counter()
    for e in prof.key_averages():
        if not str(e.device_type).endswith("CUDA"):
            host[e.key] = e.self_cpu_time_total
    out["top_host_ops_self_ms_per_step"] = [{"name": k[:80], "ms": v / 1e3 / steps} for k, v in host.most_common(15)]
    out["graph_replay_ms"] = graph_replay_ms(eng, batch, dev)
    return out


@torch.inference_mode()
def graph_replay_ms(eng, batch, dev, n=50):
    """The decode graph of `batch`'s bucket replayed back to back, nothing else queued (its static buffers hold
    the last step of the generate before): the step's GPU time with the in-graph launch gaps, without the
    host's part and the work outside the graph. Wall step time minus this is what the host and the kernels
    outside the graph cost. Flushes the cache afterwards (the replays wrote the last step's slots again)."""
    graphs = eng.runner.graphs
    if graphs is None or dev.type != "cuda":
        return None
    g = graphs.graphs[next(b for b in sorted(graphs.graphs) if b >= batch)]
    g.replay()
    sync(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    eng.flush_cache()
    return start.elapsed_time(end) / n


@torch.inference_mode()
def profile_few_shot(eng, cfg, dev, programs=128, prefix_len=1200, unique=60, new=8) -> dict:
    """gpu_bench's few-shot workload (one shared prefix, `programs` prompts, `new` greedy tokens each): programs/s
    (3 runs) and, from one profiled run, GPU kernel time by kernel, the GPU's busy share of the run and the
    engine's forward counts. Where the time goes when the GPU is not the limit: the busy share says it."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, cfg.vocab_size, (prefix_len,), generator=g).tolist()
    progs = [prefix + torch.randint(3, cfg.vocab_size, (unique,), generator=g).tolist() for _ in range(programs)]
    gen(eng, progs[:4], new)  # warm-up

    def run():
        eng.flush_cache()
        return time_call(lambda: gen(eng, progs, new), dev)

    run()
    out = {"programs": programs, "programs_s": sorted(programs / run() for _ in range(3))}
    out["cascade"] = cascade_ab(eng, progs, new, dev)
    eng.flush_cache()
    before = dict(eng.stats())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen(eng, progs, new)
        sync(dev)
    after = eng.stats()
    out["forwards"] = {k: after[k] - before[k] for k in ("prefill_forwards", "decode_forwards", "computed_tokens",
                                                          "cached_tokens")}
    kern = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if str(e.device_type).endswith("CUDA")]
    if kern:
        t0, t1 = min(k[0] for k in kern), max(k[1] for k in kern)
        per = Counter()
        for s_, e_, n in kern:
            per[n] += e_ - s_
        out["profiled_ms"] = (t1 - t0) / 1e3
        out["gpu_kernel_ms"] = sum(per.values()) / 1e3
        out["gpu_busy_share"] = busy_share([(a, b) for a, b, _ in kern], t0, t1)
        out["top_kernels"] = [{"name": n[:100], "ms": t / 1e3} for n, t in per.most_common(12)]
        out["idle_gaps"] = idle_gaps(kern, t0)
    out["host_profile"] = host_profile(lambda: gen(eng, progs, new), eng)
    return out


def step_boundary(kern, before=10, after=3) -> list[dict]:
    """The GPU work between two decode steps, at the middle step of the window: the kernels and copies around a
    graph's first kernel (decode_inputs), each with its start and end relative to that kernel (us) and the idle
    time before it. What the step costs outside its graph: sampling, the copies, the graph's launch."""
    kern = sorted(kern)
    firsts = [i for i, (_, _, n) in enumerate(kern) if "decode_inputs" in n]
    if not firsts:
        return []
    i = firsts[len(firsts) // 2]
    at = kern[i][0]
    rows, prev_end = [], None
    for s_, e_, n in kern[max(i - before, 0):i + after + 1]:
        rows.append({"name": n[:60], "start_us": round(s_ - at, 1), "end_us": round(e_ - at, 1),
                     "idle_before_us": None if prev_end is None else round(max(s_ - prev_end, 0), 1)})
        prev_end = e_ if prev_end is None else max(prev_end, e_)
    return rows


def idle_gaps(kern, t0, top=16) -> list[dict]:
    """The longest stretches with no kernel running (ms from the first kernel, length, the kernels either side):
    where the GPU waits on the host."""
    kern = sorted(kern)
    gaps, end, prev = [], kern[0][1], kern[0][2]
    for s_, e_, n in kern[1:]:
        if s_ > end:
            gaps.append({"at_ms": round((end - t0) / 1e3, 2), "ms": round((s_ - end) / 1e3, 3),
                         "after": prev[:50], "before": n[:50]})
        if e_ > end:
            end, prev = e_, n
    gaps.sort(key=lambda g: -g["ms"])
    return [{"total_ms": round(sum(g["ms"] for g in gaps), 2), "count": len(gaps)}] + gaps[:top]


def host_profile(run, eng, top=30) -> list[str]:
    """cProfile of the scheduler thread's steps over one run of `run` (tottime order), with each step's host
    time: what the host does while the GPU may wait. As text lines."""
    import cProfile
    import io
    import pstats
    import time

    eng.flush_cache()
    sched, pr, spans = eng.scheduler, cProfile.Profile(), []
    step = sched.step

    def profiled_step():
        t = time.perf_counter()
        pr.enable()
        try:
            return step()
        finally:
            pr.disable()
            spans.append((t, time.perf_counter()))
    sched.step = profiled_step
    try:
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
    finally:
        del sched.step
    buf = io.StringIO()
    buf.write(f"run {1e3 * (t1 - t0):.1f} ms, {len(spans)} steps, host in steps {1e3 * sum(b - a for a, b in spans):.1f} ms;"
              f" steps (start, ms): {[(round(1e3 * (a - t0), 1), round(1e3 * (b - a), 2)) for a, b in spans]}\n")
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue().splitlines()


@contextmanager
def cascade_off():
    """Decode without the shared-prefix cascade (triton_backend's bound out of reach): every request reads the
    shared prefix itself, as before the cascade."""
    from lmc.runtime.attention import triton_backend

    saved = triton_backend.SHARED_PREFIX_MIN_BYTES
    triton_backend.SHARED_PREFIX_MIN_BYTES = 1 << 62
    try:
        yield
    finally:
        triton_backend.SHARED_PREFIX_MIN_BYTES = saved


@torch.inference_mode()
def cascade_ab(eng, progs, new, dev, rounds=3) -> dict:
    """The few-shot workload with the cascade on and off, alternately (`rounds` each, after one warm-up of each):
    programs/s, and whether greedy tokens agree (bf16: the merge's summation order differs, so a near-tie may
    flip a token; the count says how many programs differ)."""
    def run(off: bool):
        eng.flush_cache()
        res = []
        with cascade_off() if off else nullcontext():
            t = time_call(lambda: res.extend(gen(eng, progs, new)), dev)
        return t, [r["output_ids"] for r in res]

    run(False), run(True)
    on, off = [], []
    for _ in range(rounds):
        on.append(run(False))
        off.append(run(True))
    n = len(progs)
    return {"programs_s_on": sorted(n / t for t, _ in on), "programs_s_off": sorted(n / t for t, _ in off),
            "programs_with_other_tokens": sum(a != b for a, b in zip(on[-1][1], off[-1][1]))}


def apply_sweep(path: str) -> None:
    from lmc.runtime.kernels import skinny_gemm

    with open(path) as f:
        rows = json.load(f)["shapes"]
    for r in rows:
        key = (skinny_gemm._block_m(r["M"]), r["N"], r["K"])
        if r["best"]["us"] < 0.98 * r["cublas_us"]:
            skinny_gemm.CONFIGS[key] = tuple(r["best"]["config"])
        else:
            skinny_gemm.CONFIGS.pop(key, None)
        print("skinny config", key, skinny_gemm.CONFIGS.get(key), f"{r['best']['us']:.1f} us against cuBLAS "
              f"{r['cublas_us']:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-tokens", type=int, default=81920)  # batch 256 x 288 tokens fits
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape: checks the script")
    ap.add_argument("--few-shot", action="store_true", help="also profile gpu_bench's few-shot workload")
    ap.add_argument("--skinny-configs", default=None,
                    help="a gpu_gemm_sweep.py output: use its best tile per shape where it beat cuBLAS by 2%% "
                         "(tries a sweep's tiles before they are written into skinny_gemm.CONFIGS)")
    args = ap.parse_args()
    if args.skinny_configs:
        apply_sweep(args.skinny_configs)
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.shape, args.prompt_len, args.steps, args.kv_tokens = "tiny", 16, 3, 4096
    batches = [int(b) for b in args.batches.split(",") if b]
    cfg, hf, eng = build(args.shape, dev, torch.float32 if args.smoke else torch.bfloat16, args.kv_tokens, "auto",
                         max(batches + [256 if args.few_shot else 1]))  # few-shot decodes at batch 128
    del hf
    res = {"shape": args.shape, "device": "cpu" if args.smoke else torch.cuda.get_device_name(),
           "paths": {"attention": type(eng.runner.attn).__name__, "cuda_graphs": eng.runner.graphs is not None,
                     "graph_buckets": sorted(eng.runner.graphs.graphs) if eng.runner.graphs else [],
                     "overlap_schedule": eng.overlap_schedule,
                     "fused_on_cuda": kernels._fused(torch.empty(1, device=dev))},
           "batches": []}
    for b in batches:
        res["batches"].append(profile_batch(eng, cfg, dev, b, args.prompt_len, args.steps))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.few_shot:
        res["few_shot"] = profile_few_shot(eng, cfg, dev, *((8, 100, 12, 4) if args.smoke else ()))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        fs = res["few_shot"]
        print(f"few-shot cascade A/B: {fs['cascade']}")
        print(f"few-shot: {fs['programs_s']} programs/s, forwards {fs['forwards']}, GPU kernels "
              f"{fs.get('gpu_kernel_ms', 0):.1f} ms of {fs.get('profiled_ms', 0):.1f}, "
              f"busy {fs.get('gpu_busy_share', 1):.0%}")
        for k in fs.get("top_kernels", [])[:10]:
            print(f"   {k['ms']:.2f} ms  {k['name']}")
        for g_ in fs.get("idle_gaps", []):
            print("   gap", g_)
        print("\n".join(fs["host_profile"]))
    eng.shutdown()
    print(json.dumps(res["paths"]))
    for r in res["batches"]:
        print(f"batch {r['batch']}: wall on {r['wall_ms_per_step_overlap_on']} off {r['wall_ms_per_step_overlap_off']}"
              f" | gpu kernels {r['gpu_kernel_ms_per_step']:.3f} ms/step, window {r['profiled_window_ms_per_step']:.3f},"
              f" busy {r['gpu_busy_share_of_window']:.0%}, launches {r['launches_per_step']:.0f}, same tokens "
              f"{r['greedy_tokens_equal_overlap_on_off']}, graph replay alone {r['graph_replay_ms']} ms, "
              f"calls {r['calls_during_generate']}")
        for k in r["top_kernels"][:12]:
            print(f"   {k['ms_per_step']:.4f} ms x{k['per_step']:.0f}  {k['name']}")
        for h in r["top_host_ops_self_ms_per_step"][:8]:
            print(f"   host {h['ms']:.4f} ms  {h['name']}")


if __name__ == "__main__":
    main()
