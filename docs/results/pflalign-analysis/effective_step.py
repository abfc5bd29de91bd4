"""Issue 38, question 1 on the validation protocol: each method's validation Avg against the
SGD-equivalent step it took. For pFLAlign that is lr x its measured step ratio ||P.g||/||g||
(mean over all clients and rounds of its client_round lines); every other method of the grid
takes SGD's step, so its own lr. If pFLAlign's deficit were its step size alone, its points would
lie on FedAvg's curve. Writes validation/effective-step.png and prints the table for README.md; then the same view of
the full-protocol runs (runs/ beside Table 1's runs of the same five methods, mean Avg over the seeds
with its 95% interval) in effective-step.png, each pFLAlign step ratio the mean over its own run's
client_round lines (Table 1's runs predate them: its pFLAlign takes the ratio of the curves run that
re-makes its seed 0 once that is in, until then its 10-round validation run's at the same lr, 0.121,
which the 50 rounds may lower: the ratio falls over the rounds).

    .venv/bin/python docs/results/pflalign-analysis/effective_step.py
"""

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pflalign.analysis.figure_style import DPI, legend_outside, style  # noqa: E402
from pflalign.analysis.report import ci95_half_width, find_runs, summarize, sweeps  # noqa: E402
from pflalign.methods import label  # noqa: E402

HERE = Path(__file__).resolve().parent


def step_ratio(run) -> float | None:
    ratios = [m["step_ratio"] for m in run.events("client_round") if m.get("step_ratio") is not None]
    return statistics.fmean(ratios) if ratios else None


def save(fig, ax, ylabel: str, title: str, path: Path) -> None:
    """Both figures' common frame: a log x axis of the SGD-equivalent step, the legend outside."""
    ax.set_xscale("log")
    ax.set_xlabel("SGD-equivalent step: lr × mean ‖P⊙g‖/‖g‖ (pFLAlign), lr (the others)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    legend_outside(fig, *ax.get_legend_handles_labels(), fontsize=8)
    fig.savefig(path, dpi=DPI)


def validation_figure() -> None:
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
    save(fig, ax, "validation Avg, personalized ROUGE-L (×100)",
         "10-round validation protocol, seed 0 (diverged runs left out)", HERE / "validation" / "effective-step.png")
    print("\n".join(lines))


TABLE1 = HERE.parent / "table1-flan" / "runs"
FULL_METHODS = ["fedavg", "fedsa-lora", "feddyn", "local", "pflalign"]


def full_points(runs) -> dict[str, list[tuple[float, float, float | None, str]]]:
    """Series name → (SGD-equivalent step, mean Avg, its 95% CI half-width, "lr[, n seeds]") per setting,
    sorted by step (the seeds said where fewer than 3).
    pFLAlign's β 0.5 is a series of its own (its ratio is another curve); a pFLAlign setting whose ratio
    is not logged anywhere is left out."""
    curves = {r.method: r for r in find_runs(HERE / "curves" / "runs")[0] if r.seed == 0}
    validation = {r.method: r for r in find_runs(HERE / "validation" / "runs")[0]}
    by_name: dict[str, list] = {}
    for r in runs:
        by_name.setdefault(r.method, []).append(r)
    series: dict[str, list] = {}
    for name, mine in by_name.items():
        base = name.split("@")[0]
        ratios = [x for x in map(step_ratio, mine) if x is not None]
        if base == "pflalign" and not ratios:  # Table 1's: the curves run's re-make, else 10 validation rounds
            stand_in = curves.get(name) or validation.get(f"{name}@lr={mine[0].config['lr']:g}")
            ratios = [x for x in [step_ratio(stand_in) if stand_in else None] if x is not None]
        if base == "pflalign" and not ratios:
            continue
        lr = mine[0].config["lr"]
        beta = mine[0].config.get("method_args", {}).get("beta")
        key = f"pflalign (β {beta:g})" if base == "pflalign" else base
        avgs = [r.results["avg_rouge_l_personalized"] for r in mine]
        step = lr * (statistics.fmean(ratios) if ratios else 1.0)
        seeds = "" if len(mine) >= 3 else f", {len(mine)} seed{'s' if len(mine) > 1 else ''}"
        series.setdefault(key, []).append((step, statistics.fmean(avgs), ci95_half_width(avgs), f"{lr:g}{seeds}"))
    return {k: sorted(v) for k, v in series.items()}


def full_figure() -> None:
    runs = [r for r in find_runs(HERE / "runs")[0] if "personalized=" not in r.method]
    if not runs:
        return
    for m in FULL_METHODS:
        runs += find_runs(TABLE1 / "flan" / m)[0]
    fig, ax = plt.subplots(figsize=(7.4, 4.2), layout="constrained")
    for i, (key, points) in enumerate(full_points(runs).items()):
        points = [(x * 1.025 ** (i - 2), *rest) for x, *rest in points]  # dodge: settings share an lr
        method = key.split(" ")[0]
        st = style(method)
        if method == "pflalign" and "0.8" not in key:  # β 0.5 beside Table 1's β 0.8
            st = {**st, "linestyle": "--", "color": "dimgray"}
        x, y = [p[0] for p in points], [p[1] for p in points]
        err = [p[2] or 0.0 for p in points]
        name = label(method) + key[len(method):]
        ax.errorbar(x, y, yerr=err, marker="o", markersize=3.5, capsize=2, label=name, **st)
        for px, py, _, lr in (p for p in points if p[3] != "0.04"):  # the unmarked: Table 1's lr
            ax.annotate(f"lr {lr}", (px, py), textcoords="offset points", xytext=(4, 3), fontsize=6.5, color=st["color"])
    save(fig, ax, "Avg personalized ROUGE-L (×100)\nmean over seeds ± 95% CI",
         "Full FLAN protocol, 50 rounds (unmarked points: lr 0.04)", HERE / "effective-step.png")


def main() -> None:
    validation_figure()
    full_figure()


if __name__ == "__main__":
    main()
