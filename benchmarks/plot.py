"""Bar charts of the recorded results (benchmarks/results/*.json) -> benchmarks/results/summary.png and
compiler_ablation.png."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "results")


def main():
    cpu = json.load(open(os.path.join(HERE, "cpu.json")))
    gpu = json.load(open(os.path.join(HERE, "h200_bf16.json")))
    panels = [
        ("CPU few-shot (programs/s)", {"lmc": cpu["few_shot"]["lmc_programs_s"],
                                       "transformers": cpu["few_shot"]["hf_programs_s"]}),
        ("CPU decode, batch 16 (tok/s)", {"lmc": cpu["decode"]["lmc_tok_s"], "transformers": cpu["decode"]["hf_tok_s"]}),
        ("H200 few-shot, 7B (programs/s)", {"lmc": gpu["few_shot"]["lmc_programs_s"],
                                            "transformers": gpu["few_shot"]["hf_programs_s"]}),
    ] + [(f"H200 decode, 7B, batch {d['batch']} (ms/step)",
          {"lmc": d["lmc_ms_per_step"], "transformers": d["hf_ms_per_step"], "weight-read floor": d["floor_ms_per_step"]})
         for d in gpu["decode"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    colors = {"lmc": "#2a7ab9", "transformers": "#b0b0b0", "weight-read floor": "#6bbf59"}
    for ax, (title, vals) in zip(axes, panels):
        bars = ax.bar(list(vals), list(vals.values()), color=[colors[k] for k in vals])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    out = os.path.join(HERE, "summary.png")
    fig.savefig(out, dpi=110)
    print(out)
    compiler_ablation()


def compiler_ablation():
    """programs/s of each compiler configuration relative to the interpreter, per workload (the paper's Fig. 8c)."""
    data = json.load(open(os.path.join(HERE, "compiler.json")))
    configs = [c for c in next(iter(data.values())) if isinstance(next(iter(data.values()))[c], dict)]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        xs = [i + j * width for i in range(len(data))]
        rel = [row[c]["programs_s"] / row["interpreted"]["programs_s"] for row in data.values()]
        bars = ax.bar(xs, rel, width, label=c)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(data))], list(data))
    ax.set_ylabel("programs/s vs interpreted")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    out = os.path.join(HERE, "compiler_ablation.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
