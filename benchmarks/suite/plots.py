"""The suite's pictures (PNG, matplotlib) from its results JSON: Figure-5-style normalized throughput, Figure-6-style
latency, Figure-13-style achieved vs optimal cache hit rate, and the Figure-8-style ablation on tree-of-thought.
Error bars are the min-max spread of the runs."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def workload_names(results: dict) -> list[str]:
    return [k for k in results if not k.startswith("_")]


def system_names(results: dict) -> list[str]:
    return results["_meta"]["systems"]


def _bars(ax, results, key: str, normalize: bool):
    wls, systems = workload_names(results), system_names(results)
    width = 0.8 / len(systems)
    x = np.arange(len(wls))
    for i, s in enumerate(systems):
        med, lo, hi = [], [], []
        for w in wls:
            f = results[w].get(s, {})
            base = results[w]["lmc"][key] if normalize else 1.0
            m = f.get(key)
            med.append(m / base if m is not None else 0.0)
            lo.append((m - f[f"{key}_min"]) / base if m is not None else 0.0)
            hi.append((f[f"{key}_max"] - m) / base if m is not None else 0.0)
        ax.bar(x + (i - (len(systems) - 1) / 2) * width, med, width, yerr=[lo, hi], capsize=2, label=s)
    ax.set_xticks(x)
    ax.set_xticklabels([w.replace("_", "\n") for w in wls], fontsize=7)
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def has_latency(results: dict) -> bool:
    return any(isinstance(results[w][s].get("latency_s"), dict)
               for w in workload_names(results) for s in results[w])


def throughput(results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 3.6))
    _bars(ax, results, "programs_per_s", normalize=True)
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_ylabel("throughput / lmc's")
    ax.set_title("Normalized throughput (programs/s, median of runs, min-max bars; higher is better)")
    return _save(fig, path)


def latency(results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 3.6))
    _bars(ax, results, "latency_s", normalize=False)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per program")
    ax.set_title("Latency, one program at a time (median of runs, min-max bars; lower is better)")
    return _save(fig, path)


def hit_rates(results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    markers = "osD^v<>"
    for i, s in enumerate(system_names(results)):
        xs, ys = [], []
        for w in workload_names(results):
            f = results[w].get(s, {})
            if "hit_rate" in f and f.get("optimal_hit_rate"):
                xs.append(f["optimal_hit_rate"] * 100)
                ys.append(f["hit_rate"] * 100)
        ax.scatter(xs, ys, marker=markers[i % len(markers)], label=s, s=22)
    ax.plot([0, 100], [0, 100], color="grey", lw=0.6)
    ax.set_xlabel("optimal cache hit rate (%)")
    ax.set_ylabel("achieved cache hit rate (%)")
    ax.set_title("Achieved vs optimal hit rate, per workload")
    ax.legend(fontsize=7)
    return _save(fig, path)


def ablation(results: dict, path: Path) -> Path:
    rates = results["_ablation"]["rates"]
    pts = sorted((v["hit_rate"] * 100, v["programs_per_s"], v["programs_per_s_min"], v["programs_per_s_max"], k)
                 for k, v in rates.items())
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    ax.errorbar(xs, ys, yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]], marker="o", capsize=3)
    for x, y, *_, k in pts:
        ax.annotate(f"drop {float(k):.0%}", (x, y), fontsize=7, textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("cache hit rate (%)")
    ax.set_ylabel("programs/s")
    ax.set_title(f"Ablation on {results['_ablation']['workload']}: hit rate vs throughput")
    return _save(fig, path)


def write_all(results: dict, out_dir: Path, prefix: str = "suite_cpu") -> list[Path]:
    out_dir = Path(out_dir)
    paths = [throughput(results, out_dir / f"{prefix}_throughput.png")]
    if has_latency(results):  # a throughput-only run (--latency-runs 0 and no one-program batch) has none
        paths.append(latency(results, out_dir / f"{prefix}_latency.png"))
    paths.append(hit_rates(results, out_dir / f"{prefix}_hit_rate.png"))
    if "_ablation" in results:
        paths.append(ablation(results, out_dir / f"{prefix}_ablation.png"))
    return paths
