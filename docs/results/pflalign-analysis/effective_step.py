"""Issue 38, question 1 on the validation protocol: each method's validation Avg against the
SGD-equivalent step it took. For pFLAlign that is lr x its measured step ratio ||P.g||/||g||
(mean over all clients and rounds of its client_round lines); every other method of the grid
takes SGD's step, so its own lr. If pFLAlign's deficit were its step size alone, its points would
lie on FedAvg's curve. Writes validation/effective-step.png and prints the table for README.md.

    .venv/bin/python docs/results/pflalign-analysis/effective_step.py
"""

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pflalign.analysis.figures import DPI, style  # noqa: E402
from pflalign.analysis.report import find_runs, summarize, sweeps  # noqa: E402
from pflalign.methods import label  # noqa: E402

HERE = Path(__file__).resolve().parent


def step_ratio(run) -> float | None:
    ratios = [m["step_ratio"] for m in run.events("client_round") if m.get("step_ratio") is not None]
    return statistics.fmean(ratios) if ratios else None


def main() -> None:
    runs, _ = find_runs(HERE / "validation" / "runs")
    runs = [r for r in runs if "personalized=" not in r.method]
    _, rows = summarize(runs)
    ratio = {r.method: step_ratio(r) for r in runs}
    fig, ax = plt.subplots(figsize=(7.4, 4.2), layout="constrained")
    lines = ["| method | lr | step ratio | SGD-equivalent step | validation Avg |", "| :-- | --: | --: | --: | --: |"]
    for s in (s for s in sweeps(rows) if s.setting == "lr"):
        points = [(lr, row) for lr, row in s.points if not row.diverged_seeds]
        eff = [lr * (ratio[row.method] or 1.0) for lr, row in points]
        st = style(s.name)
        ax.plot(eff, [row.avg for _, row in points], marker="o", markersize=3.5, label=label(s.name), **st)
        if any(ratio[row.method] for _, row in points):  # pFLAlign: its nominal lr too, faint
            ax.plot([lr for lr, _ in points], [row.avg for _, row in points], marker=".", color=st["color"],
                    alpha=0.3, linestyle=":", label=f"{label(s.name)} at its nominal lr")
        for (lr, row), e in zip(points, eff):
            r = ratio[row.method]
            lines.append(f"| {label(s.name)} | {lr:g} | {'1 (SGD)' if r is None else f'{r:.3f}'} | {e:.2g} | "
                         f"{row.avg:.2f} |")
    ax.set_xscale("log")
    ax.set_xlabel("SGD-equivalent step: lr × mean ‖P⊙g‖/‖g‖ (pFLAlign), lr (the others)")
    ax.set_ylabel("validation Avg, personalized ROUGE-L (×100)")
    ax.grid(True, alpha=0.3)
    ax.set_title("10-round validation protocol, seed 0 (diverged runs left out)", fontsize=10)
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    fig.savefig(HERE / "validation" / "effective-step.png", dpi=DPI)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
