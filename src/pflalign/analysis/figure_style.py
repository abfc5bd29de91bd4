"""How every figure of the report looks: each method keeps one colour in every figure, fixed by
the method's place in the registry (families in the paper's order), not by which methods a report
happens to hold; pFLAlign is drawn black and thicker, LoRA-modulation baselines dashed (`style`).
The legend sits right of the axes (`legend_outside`); PNGs at `DPI`.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures are drawn without a display
import matplotlib.pyplot as plt  # noqa: E402

from ..methods import FAMILIES, family  # noqa: E402

DPI = 150
_KNOWN = [m for _, members in FAMILIES for m in members if m != "pflalign"]
_TAB20 = plt.get_cmap("tab20").colors
_PALETTE = list(_TAB20[0::2]) + list(_TAB20[1::2])  # the 10 strong colours first, then their light twins


def style(method: str) -> dict:
    """Colour, line style and width of a method, the same in every figure."""
    if method == "pflalign":
        return {"color": "black", "linestyle": "-", "linewidth": 2.4, "zorder": 5}
    if method in _KNOWN:
        color = _PALETTE[_KNOWN.index(method) % len(_PALETTE)]
    else:
        color = plt.get_cmap("tab20b").colors[zlib.crc32(method.encode()) % 20]
    dashes = {"LoRA-modulation": "--", "pFLAlign": "-."}.get(family(method), "-")
    return {"color": color, "linestyle": dashes, "linewidth": 1.4, "zorder": 3}


LEGEND_FONT = 8.5  # points


def legend_outside(fig, handles: list, labels: list, fontsize: float = LEGEND_FONT) -> None:
    """A legend right of the axes, in as many columns as its entries need to fit the figure's
    height (a sweep's report has forty rows: one column would run off the image)."""
    fits = max(1, int(fig.get_figheight() * 72 / (fontsize * 1.6)) - 1)  # entry height ~1.6 x the font
    ncols = max(1, math.ceil(len(labels) / fits))
    if ncols > 1:  # widen the figure by the extra columns, so that the axes keep their width
        column = (max(map(len, labels)) * 0.55 * fontsize + 30) / 72  # inches: text, marker and gap
        fig.set_figwidth(fig.get_figwidth() + (ncols - 1) * column)
    fig.legend(handles, labels, loc="outside right upper", fontsize=fontsize, frameon=False, ncols=ncols)


def _finish(fig, axes, path: Path, title: str) -> bool:
    """The first panel's legend on the right, the title over a lone panel (clear of the legend)
    or over the figure; saved and closed."""
    legend_outside(fig, *axes[0][0].get_legend_handles_labels())
    if len(axes[0]) == 1:
        axes[0][0].set_title(title, fontsize=11)
    else:
        fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True
