"""Bar charts of the recorded results (benchmarks/results/*.json) -> results/summary.png and
compiler_examples.png. Bars are medians, whiskers the min-max of the runs; the same figures as RESULTS.md's tables
(report.py calls this after writing them)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, is_spread  # noqa: E402

COLORS = {"lmc": "#2a7ab9", "transformers": "#b0b0b0", "weight-read floor": "#6bbf59"}
PNG_METADATA = {"Software": None}  # no version stamp: the same JSON gives the same file


def summary_panels(results_dir: Path) -> list[tuple[str, dict, int]]:
    """(title, {label: figure}, decimals) per panel, figures as stored (a spread or a number); the decimals are
    RESULTS.md's for the same figure, so a bar's label reads as its table cell."""
    panels = []
    cpu_p, gpu_p = results_dir / "cpu.json", results_dir / "h200_bf16.json"
    if cpu_p.exists():
        cpu = json.loads(cpu_p.read_text())
        if "few_shot" in cpu:
            f = cpu["few_shot"]
            panels.append(("CPU few-shot (programs/s)", {"lmc": f["lmc_programs_s"], "transformers": f["hf_programs_s"]},
                           2))
        if "decode" in cpu:
            d = cpu["decode"]
            panels.append((f"CPU decode, batch {d['batch']} (ms/step)",
                           {"lmc": d["lmc_ms_per_step"], "transformers": d["hf_ms_per_step"]}, 1))
    if gpu_p.exists():
        gpu = json.loads(gpu_p.read_text())
        if "few_shot" in gpu:
            f = gpu["few_shot"]
            panels.append(("H200 few-shot, 7B (programs/s)",
                           {"lmc": f["lmc_programs_s"], "transformers": f["hf_programs_s"]}, 1))
        for d in gpu.get("decode", []):
            panels.append((f"H200 decode, 7B, batch {d['batch']} (ms/step)",
                           {"lmc": d["lmc_ms_per_step"], "transformers": d["hf_ms_per_step"],
                            "weight-read floor": d["floor_ms_per_step"]}, 2))
    return panels


def _bars(ax, xs, figures, width=0.8, **kw):
    med = [f["median"] if is_spread(f) else f for f in figures]
    lo = [m - (f["min"] if is_spread(f) else m) for m, f in zip(med, figures)]
    hi = [(f["max"] if is_spread(f) else m) - m for m, f in zip(med, figures)]
    bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, error_kw={"linewidth": 0.8}, **kw)
    return bars


def summary(results_dir: Path) -> Path | None:
    panels = summary_panels(results_dir)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (title, vals, digits) in zip(axes[0], panels):
        bars = _bars(ax, list(vals), list(vals.values()), color=[COLORS[k] for k in vals])
        ax.bar_label(bars, fmt=f"%.{digits}f", fontsize=8, label_type="center")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("medians; whiskers: min-max of the runs", fontsize=8)
    fig.tight_layout()
    out = results_dir / "summary.png"
    fig.savefig(out, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return out


def compiler_examples(results_dir: Path, stem: str = "compiler_examples") -> Path | None:
    """Compiled / interpreted programs/s per example: the bar is the per-repetition ratios' median, whiskers their
    min-max (the two modes alternate, so each repetition's ratio compares runs made under the same load). One plot
    per record: `stem` is the CPU's or the H200's (compiler_examples_h200)."""
    p = results_dir / f"{stem}.json"
    if not p.exists():
        return None
    examples = json.loads(p.read_text())["examples"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bars = _bars(ax, list(examples), [e["ratio"] for e in examples.values()], 0.6, color=COLORS["lmc"])
    ax.bar_label(bars, fmt="%.2f", fontsize=7, label_type="center")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_ylabel("compiled / interpreted programs/s")
    ax.set_title("per-repetition ratio: median, whiskers min-max", fontsize=8)
    ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    fig.tight_layout()
    out = results_dir / f"{stem}.png"
    fig.savefig(out, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return out


def main(results_dir: Path = RESULTS_DIR) -> None:
    for out in (summary(results_dir), compiler_examples(results_dir),
                compiler_examples(results_dir, "compiler_examples_h200")):
        if out:
            print(out)


if __name__ == "__main__":
    main()
