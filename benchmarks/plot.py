"""Bar charts of the recorded results (benchmarks/results/*.json) -> benchmarks/results/summary.png."""
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


if __name__ == "__main__":
    main()
