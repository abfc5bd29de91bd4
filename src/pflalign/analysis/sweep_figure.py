"""The sweeps' figure: Avg against the swept value, one panel per setting, one line per sweep.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures are drawn without a display
import matplotlib.pyplot as plt  # noqa: E402

from ..methods import label  # noqa: E402

from .figure_style import _finish, style  # noqa: E402
from .tables import sweeps  # noqa: E402

if TYPE_CHECKING:  # the rows `report` hands in
    from .tables import Row


def _sweeps_figure(path: Path, rows: list[Row]) -> bool:
    """Avg against the swept value, one panel per setting, one line per sweep (log x when the
    values span a decade or more); the best value ringed. A diverged point (its Avg measures the
    blow-up) is left off the line and drawn as × at the axis's foot, so it does not squash the rest."""
    found = sweeps(rows)
    if not found:
        return False
    settings = list(dict.fromkeys(s.setting for s in found))
    fig, axes = plt.subplots(1, len(settings), figsize=(5.4 * len(settings) + 1.8, 3.9), layout="constrained",
                             squeeze=False)
    for ax, setting in zip(axes[0], settings):
        mine = [s for s in found if s.setting == setting]
        held = [(v, row) for s in mine for v, row in s.points if not row.diverged_seeds]
        low = min([row.avg - (row.avg_ci or 0.0) for _, row in held], default=0.0)
        high = max([row.avg + (row.avg_ci or 0.0) for _, row in held], default=1.0)
        margin = max(1.0, 0.08 * (high - low))
        for s in mine:
            st = style(s.name.partition("@")[0])
            kept = [(v, row) for v, row in s.points if not row.diverged_seeds]
            errs = [row.avg_ci or 0.0 for _, row in kept]
            if kept:
                ax.errorbar([v for v, _ in kept], [row.avg for _, row in kept], yerr=errs if any(errs) else None,
                            label=label(s.name), marker="o", markersize=3.5, capsize=2, **st)
            gone = [v for v, row in s.points if row.diverged_seeds]
            if gone:
                ax.plot(gone, [low - margin] * len(gone), marker="x", markersize=8, color=st["color"],
                        linestyle="none", clip_on=False, zorder=7)
            best = s.best()
            if best is not None:
                ax.plot([best], [next(row.avg for v, row in s.points if v == best)], marker="o", markersize=11,
                        markerfacecolor="none", markeredgecolor=st["color"], linestyle="none", zorder=6)
        ax.set_ylim(low - margin, high + margin)
        values = sorted({v for s in mine for v, _ in s.points})
        if values[0] > 0 and values[-1] >= 10 * values[0]:
            ax.set_xscale("log")
            ax.set_xticks(values, [f"{v:g}" for v in values])
            ax.minorticks_off()
        ax.set_xlabel(setting)
        ax.set_ylabel("Avg, personalized ROUGE-L (×100)")
        ax.grid(True, alpha=0.3)
    return _finish(fig, axes, path, "Avg at each value (ring: the best; × at the foot: diverged)")
