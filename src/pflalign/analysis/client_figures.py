"""The figures of the clients' final scores: personalized ROUGE-L per client as grouped bars
(`_rouge_bars`, up to `MAX_BAR_CLIENTS` clients) and personalized against global as a scatter,
one point per client and method (`_rouge_scatter`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures are drawn without a display
import matplotlib.pyplot as plt  # noqa: E402

from ..methods import label, method_order  # noqa: E402

from .figure_style import DPI, legend_outside, style  # noqa: E402

if TYPE_CHECKING:  # the rows and runs `report` hands in
    from .runs import Run
    from .tables import Row

SCATTER_LEGEND_INSIDE = 12  # methods whose legend fits in the scatter's upper-left corner (Table 1: eleven)


def _rouge_bars(path: Path, tasks: list[str], rows: list[Row]) -> list[tuple[str, str, str]]:
    """Grouped bars: one group per client (and Avg), one bar per method, 95% CI whiskers. A whisker
    the axis cuts (below 0, or above just over 100: few seeds make long ones) ends in a triangle on
    the axis, ▼ at the bottom, ▲ at the top. Returns the cut ones as (method, client or "Avg", "low" or "high")."""
    groups = [*tasks, "Avg"]
    n = len(rows)
    width = 0.84 / n
    top = max([1.0] + [r.avg + (r.avg_ci or 0) for r in rows]
              + [v + (r.cell_ci.get(t) or 0) for r in rows for t, v in r.cells.items()])
    y_max = min(top, 100.0) * 1.05  # ROUGE-L ≤ 100: longer whiskers (few seeds) are cut there
    long = max(map(len, groups)) > TICK_CHARS  # wrapped names (`_wrapped`) need wider groups
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 + len(groups) * ((0.9 if long else 0.6) + 0.12 * n)),
                                    4.6 if long else 4.2), layout="constrained")
    cut = []
    for i, row in enumerate(rows):
        means = [row.cells.get(t, float("nan")) for t in tasks] + [row.avg]
        cis = [row.cell_ci.get(t) for t in tasks] + [row.avg_ci]
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        errs = [c if c is not None else 0.0 for c in cis]
        st = style(row.method)
        ax.bar(xs, means, width, color=st["color"], label=label(row.method),
               edgecolor="black" if row.method == "pflalign" else "none", linewidth=0.6,
               yerr=errs if any(errs) else None, error_kw={"elinewidth": 0.7, "capsize": 1.5, "ecolor": "0.3"})
        for x, group, mean, err in zip(xs, groups, means, errs):
            for side, edge, marker, beyond in (("low", 0.0, "v", mean - err < 0.0),
                                                ("high", y_max, "^", mean + err > y_max)):
                if err and beyond:
                    cut.append((row.method, group, side))
                    ax.plot([x], [edge], marker=marker, markersize=4, color="0.15", linestyle="none",
                            clip_on=False, zorder=6)
    ax.set_xticks(range(len(groups)), [_wrapped(g) for g in groups], fontsize=8 if long else None)
    ax.set_ylim(0, y_max)
    ax.set_ylabel("personalized ROUGE-L (×100)")
    seeds = {len(r.seeds) for r in rows}
    bars = "one seed each" if seeds == {1} else "mean over seeds"
    # whiskers only where a row has two seeds or more: the caption says what is drawn, no more
    whiskers = ", whiskers: 95% CI over seeds" if any(r.avg_ci is not None for r in rows) else " (no interval)"
    ax.set_xlabel(f"client (task); bars: {bars}{whiskers}" + ("; ▼ ▲: whisker cut at the axis" if cut else ""))
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    legend_outside(fig, *ax.get_legend_handles_labels())
    ax.set_title("Personalized ROUGE-L per client", fontsize=11)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # tight: long legend entries stay inside the image
    plt.close(fig)
    return cut


TICK_CHARS = 14  # a client name longer than this is wrapped under its group of bars


def _wrapped(name: str, width: int = TICK_CHARS) -> str:
    """A client name on lines of at most `width` characters, broken after its '-' and '_' (a user's
    names such as client_005-information_extraction side by side would overrun each other)."""
    lines: list[str] = []
    for token in re.split(r"(?<=[-_])", name):
        if lines and len(lines[-1]) + len(token) <= width:
            lines[-1] += token
        else:
            lines.append(token)
    return "\n".join(lines)


MAX_BAR_CLIENTS = 20  # more clients than this: the per-client bars are unreadable; the scatter shows them


def spread_coincident(points: list[tuple[float, float]], radius: float) -> list[tuple[float, float]]:
    """Where the scatter puts `points`: those that would be drawn on one spot (equal to 0.01, the
    tables' precision) each move `radius` from their value onto a ring, evenly spaced from the top
    (the j-th of k at 90° + 360°·j/k), so every one stays visible (on the label tasks many methods
    score alike); a point alone stays where it is."""
    spots: dict[tuple[float, float], list[int]] = {}
    for i, (x, y) in enumerate(points):
        spots.setdefault((round(x, 2), round(y, 2)), []).append(i)
    out = list(points)
    for members in spots.values():
        k = len(members)
        if k < 2:
            continue
        for j, i in enumerate(members):
            angle = math.pi / 2 + 2 * math.pi * j / k
            out[i] = (points[i][0] + radius * math.cos(angle), points[i][1] + radius * math.sin(angle))
    return out


SPREAD_RADIUS = 0.012  # coinciding scatter points move this fraction of the axis range (× k / 6 past 6 points)


def _rouge_scatter(path: Path, runs: list[Run]) -> bool:
    """Per-client ROUGE-L, personalized (y) against global (x), one point per client and method
    (mean over the method's seeds), with the line y = x: above it personalization helped that
    client. Small translucent markers, so that 100 clients (or 1000) still read as a cloud; points
    that coincide are spread on a small ring around their value (`spread_coincident`), said under the axes."""
    by_method: dict[str, list[tuple[float, float]]] = {}
    for method in method_order(r.method for r in runs):
        per_task: dict[str, list[tuple[float, float]]] = {}
        for r in runs:
            if r.method != method:
                continue
            for c in r.results["clients"]:
                if c.get("rouge_l_global") is not None and c.get("rouge_l_personalized") is not None:
                    per_task.setdefault(c["task"], []).append((c["rouge_l_global"], c["rouge_l_personalized"]))
        if per_task:
            by_method[method] = [(statistics.fmean(g for g, _ in v), statistics.fmean(p for _, p in v))
                                 for v in per_task.values()]
    if not by_method:
        return False
    points = [pt for pts in by_method.values() for pt in pts]
    most = max(Counter((round(x, 2), round(y, 2)) for x, y in points).values())
    radius = SPREAD_RADIUS * max(1.0, *(v for pt in points for v in pt)) * max(1.0, most / 6)
    shown = iter(spread_coincident(points, radius))
    fig, ax = plt.subplots(figsize=(5.6, 5.0), layout="constrained")
    for method, pts in by_method.items():
        xs, ys = zip(*[next(shown) for _ in pts])
        st = style(method)
        size = 28 if len(xs) <= 20 else 10
        ax.scatter(xs, ys, s=size, alpha=0.65, color=st["color"], edgecolors="none",
                   label=f"{label(method)} ({len(xs)} clients)")
    top = max(1.0, *(v for a in (ax.get_xlim(), ax.get_ylim()) for v in a))
    ax.plot([0, top], [0, top], color="0.4", linestyle="--", linewidth=0.8, label="y = x")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_aspect("equal")
    ax.set_xlabel("global ROUGE-L (×100)" + (f"\npoints that coincide are spread on a ring\nof radius {radius:.2g} "
                                               "around their value" if most > 1 else ""))
    ax.set_ylabel("personalized ROUGE-L (×100)")
    ax.grid(True, alpha=0.3)
    if len(by_method) <= SCATTER_LEGEND_INSIDE:
        ax.legend(fontsize=7.5, frameon=False, loc="upper left")
    else:  # inside, a sweep's forty rows would cover the points and squeeze the axes to nothing
        legend_outside(fig, *ax.get_legend_handles_labels(), fontsize=7.5)
    ax.set_title("Per-client ROUGE-L: personalized vs global\n(above the line: personalization helped)", fontsize=10)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True
