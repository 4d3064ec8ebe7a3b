"""Compiled vs interpreted: the example programs themselves (examples/), run_batch of N instances each, on the
embedded model.

For every example the two modes alternate R times each, the order swapped every repetition (interpreted then
compiled, then compiled then interpreted, ...) so that drift in the machine's load hits both, the radix cache
flushed before every run; recorded per mode: programs/s as a record.spread of the runs, and prefill tokens
(prompt tokens not served by the cache) and engine forwards as record.exact (a spread only if a run differed); per
example the compiled / interpreted ratio of each repetition (a spread) and the ratio of the two medians. The interpreted side
is the interpreter as a user runs it (`prog.run_batch`); the compiled side is `prog.compile()` once per example,
warmed by one batch (its tracing and segment cache are then what a user's second batch sees), run with the same
`run_batch`. Every run checks that both modes give the same variables (temperature 0).

With --deadline HH:MM (UTC), no example starts after that time and no repetition starts once it has passed:
the examples not run are listed under "not_run", and each example's spreads show how many runs they hold.

With --merge, the examples this invocation runs replace theirs in an existing --out file made with the same --n
and --repeat, and the others stay (a run too long for one command is recorded as several, e.g. one per group of
examples). Each example keeps the provenance (command, start, load) of the invocation that measured it; the
file's provenance lists every invocation's command.

    python benchmarks/compiler_bench.py [--n 32] [--repeat 5] [--only judge,react_agent] [--deadline 13:45]
                                        [--merge] [--out PATH]
"""
from __future__ import annotations

import argparse
import calendar
import importlib.util
import json
import os
import platform
import sys
import time

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lmc  # noqa: E402
from record import exact, finish, provenance, spread  # noqa: E402

# 32 countries: a run_batch of 32 instances has no two alike (with 16, instance i and i + 16 were the same program
# run twice, which the radix cache served whole)
COUNTRIES = ["France", "Spain", "Germany", "Canada", "Brazil", "India", "China", "Mexico", "Poland", "Cuba",
             "Japan", "Kenya", "Egypt", "Peru", "Chile", "Italy", "Norway", "Greece", "Turkey", "Iran", "Ghana",
             "Nepal", "Sweden", "Austria", "Portugal", "Morocco", "Vietnam", "Argentina", "Ireland", "Finland",
             "Hungary", "Thailand"]
TOPICS = ["sleep", "cooking", "running", "reading", "saving money", "learning a language", "gardening", "travel"]


def instances(name: str, n: int) -> list[dict]:
    """N argument sets per example (distinct for N <= 32, so instances share only what the program shares)."""
    c = [COUNTRIES[i % len(COUNTRIES)] for i in range(n)]
    return [{
        "few_shot_qa": lambda i: {"question": f"What is the capital of {c[i]}?"},
        "tree_of_thought": lambda i: {"question": f"What is {i} + {2 * i + 3}?", "num_thoughts": 2},
        "judge": lambda i: {"question": f"What is the capital of {c[i]}?", "answer": f"It is {c[(i + 3) % n]}."},
        "react_agent": lambda i: {"question": f"What is the population of the capital of {c[i]}?"},
        # two tips (and two thoughts above), not the default three: 32 instances of three 48-token expansions and a
        # 48-token summary take ~2.5 minutes a batch on the busy 2-core machine, which 5 alternating repetitions
        # cannot fit in a recorded run (15 minutes)
        "tip_suggestion": lambda i: {"topic": f"{TOPICS[i % len(TOPICS)]} (#{i})", "num_tips": 2},
        "calculator_agent": lambda i: {"question": f"What is {i + 2} times {i + 7}, plus {i}?"},
        "counted_list": lambda i: {"topic": f"{TOPICS[i % len(TOPICS)]} ideas"},
    }[name](i) for i in range(n)]


EXAMPLES = ["tree_of_thought", "judge", "react_agent", "tip_suggestion", "few_shot_qa", "calculator_agent",
            "counted_list"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    [prog] = [v for v in vars(mod).values() if isinstance(v, lmc.Program) and v.func.__module__ == mod.__name__]
    return prog


def measure(backend, run) -> dict:
    engine = backend.engine
    engine.flush_cache()
    s0 = dict(engine.stats())
    t = time.perf_counter()
    states = run()
    secs = time.perf_counter() - t
    s1 = engine.stats()
    errors = [st.error() for st in states if st.error() is not None]
    if errors:
        raise errors[0]
    prefill = (s1["prompt_tokens"] - s0["prompt_tokens"]) - (s1["cached_tokens"] - s0["cached_tokens"])
    return {"programs_s": len(states) / secs, "prefill_tokens": prefill, "forwards": s1["forwards"] - s0["forwards"],
            "variables": [st.variables() for st in states], "text": [st.text() for st in states]}


def summary(runs: list[dict]) -> dict:
    return {"programs_s": spread([r["programs_s"] for r in runs]),
            "prefill_tokens": exact([r["prefill_tokens"] for r in runs]),
            "forwards": exact([r["forwards"] for r in runs])}


def _deadline(hhmm: str) -> float:
    """Today's HH:MM UTC as a timestamp."""
    hours, minutes = (int(x) for x in hhmm.split(":"))
    now = time.gmtime()
    return calendar.timegm((now.tm_year, now.tm_mon, now.tm_mday, hours, minutes, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32, help="instances per run_batch")
    ap.add_argument("--repeat", type=int, default=5, help="runs per mode (alternating)")
    ap.add_argument("--only", default=None, help="comma-separated examples (default: all seven)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="e.g. dummy:tiny@smollm2-135m-instruct: forwards of ~1 ms on the CPU, so the host's share "
                         "of a program (what a GPU's fast forwards leave) shows")
    ap.add_argument("--deadline", default=None, help="HH:MM UTC: start no example or repetition after it")
    ap.add_argument("--note", default="", help="added to the JSON (e.g. how busy the machine was)")
    ap.add_argument("--merge", action="store_true", help="keep the other examples of an existing --out file")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "compiler_examples.json"))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else EXAMPLES
    unknown = sorted(set(names) - set(EXAMPLES))
    if unknown:
        ap.error(f"--only: unknown example(s) {unknown}; the examples are {', '.join(EXAMPLES)}")
    deadline = _deadline(args.deadline) if args.deadline else None
    past = (lambda: time.time() >= deadline) if deadline else (lambda: False)
    backend = lmc.Local(args.model, device=args.device)
    config = {"n": args.n, "repeat": args.repeat, "device": str(backend.engine.runner.device), "model": args.model,
              "machine": platform.node(), "order": "swapped every repetition"}
    invocation = provenance("benchmarks/compiler_bench.py", args.note)
    results = {"config": config, "provenance": dict(invocation), "examples": {}, "not_run": []}
    if args.merge:
        results = merged(args.out, config, invocation, names)
    for name in names:
        if past():
            results["not_run"].append(name)
            continue
        prog, items = load(name), instances(name, args.n)
        compiled = prog.compile()
        prog.run_batch(items[:2], backend=backend, temperature=0)  # warm-up (and the compiled program's traces)
        compiled.run_batch(items, backend=backend, temperature=0)
        modes = {"interpreted": lambda: prog.run_batch(items, backend=backend, temperature=0),
                 "compiled": lambda: compiled.run_batch(items, backend=backend, temperature=0)}
        runs = {m: [] for m in modes}
        same = True
        load_avg = [os.getloadavg()[0]]
        for rep in range(args.repeat):
            if rep and past():
                break
            for mode in list(modes)[::1 if rep % 2 == 0 else -1]:  # alternating, the order swapped every time
                runs[mode].append(measure(backend, modes[mode]))
            same &= runs["compiled"][-1]["variables"] == runs["interpreted"][-1]["variables"] and \
                runs["compiled"][-1]["text"] == runs["interpreted"][-1]["text"]
        load_avg.append(os.getloadavg()[0])
        row = {m: summary(r) for m, r in runs.items()}
        row["load_avg_1m"] = {"start": load_avg[0], "end": load_avg[1]}
        row["ratio"] = spread([c["programs_s"] / i["programs_s"]  # per repetition: same load on both
                               for c, i in zip(runs["compiled"], runs["interpreted"])])
        row["ratio_of_medians"] = row["compiled"]["programs_s"]["median"] / row["interpreted"]["programs_s"]["median"]
        row["same_variables_and_text"] = same
        row["segments"] = dict(compiled.stats)
        row["provenance"] = finish(dict(invocation))
        results["examples"][name] = row
        results["examples"] = {k: results["examples"][k] for k in EXAMPLES if k in results["examples"]}
        med = {m: row[m]["programs_s"] for m in modes}
        print(f"{name:17s} interpreted {med['interpreted']['median']:7.2f} [{med['interpreted']['min']:.2f}-"
              f"{med['interpreted']['max']:.2f}]  compiled {med['compiled']['median']:7.2f} "
              f"[{med['compiled']['min']:.2f}-{med['compiled']['max']:.2f}] programs/s  "
              f"x{row['ratio_of_medians']:.2f}  prefill {row['interpreted']['prefill_tokens']} -> "
              f"{row['compiled']['prefill_tokens']}  forwards "
              f"{row['interpreted']['forwards']} -> {row['compiled']['forwards']}  same={same}", flush=True)
        save(results, args.out)  # after every example: a long run stopped early keeps what it measured
    if results["not_run"]:
        print(f"not run (past the deadline): {', '.join(results['not_run'])}", flush=True)
        save(results, args.out)
    backend.shutdown()


def merged(path: str, config: dict, invocation: dict, names: list[str]) -> dict:
    """The results of an earlier invocation (same n and repeat) with `names` to be measured again: their rows
    and not_run entries go, the others stay; the file's provenance lists both invocations' commands."""
    if not os.path.exists(path):
        return {"config": config, "provenance": dict(invocation), "examples": {}, "not_run": []}
    with open(path) as f:
        old = json.load(f)
    def size(c: dict) -> str:
        return f"--n {c['n']} --repeat {c['repeat']} --model {c.get('model', 'smollm2-135m-instruct')}"

    if size(old["config"]) != size(config):
        sys.exit(f"--merge: {path} was made with {size(old['config'])}, not {size(config)}; merge only runs of "
                 "one size and model")
    prov = old["provenance"]
    commands = [c for c in prov["command"].split(" && ") if c != invocation["command"]] + [invocation["command"]]
    prov.update(command=" && ".join(commands), note=invocation["note"] or prov.get("note", ""))
    return {"config": old["config"], "provenance": prov,
            "examples": {k: v for k, v in old["examples"].items() if k not in names},
            "not_run": [k for k in old.get("not_run", []) if k not in names]}


def save(results: dict, path: str) -> None:
    finish(results["provenance"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
