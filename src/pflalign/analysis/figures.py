"""The report's figures (matplotlib, Agg backend, PNG), one dataset at a time.

Every curve is a mean over the method's seeds. Each method keeps one colour in
every figure: the colour is fixed by the method's place in the registry
(families in the paper's order), not by which methods a report happens to
hold; pFLAlign is drawn black and thicker, LoRA-modulation baselines dashed.
A figure whose data is missing (e.g. no `round_eval` lines) is skipped and
the reason is returned for report.md.
"""

from __future__ import annotations

import math
import re
import statistics
import zlib
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..methods import FAMILIES, family, label, method_order  # noqa: E402
from ..settings import flat  # noqa: E402

from .runs import figure_client  # noqa: E402  (report does not import this module: report_md does)
from .tables import sweeps

if TYPE_CHECKING:  # the rows and runs `report` hands in
    from .runs import Run
    from .tables import Row

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


def _mean_curve(runs: list[Run], points) -> tuple[list, list]:
    """Mean over runs of {x: y} curves (x kept where any run has it)."""
    by_x: dict = {}
    for r in runs:
        for x, y in points(r).items():
            if y is not None:
                by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    return xs, [statistics.fmean(by_x[x]) for x in xs]


SCATTER_LEGEND_INSIDE = 12  # methods whose legend fits in the scatter's upper-left corner (Table 1: eleven)


def _moving_mean(xs: list, ys: list, window: int) -> tuple[list, list]:
    """Trailing mean over `window` points (from the window-th point on): a readable loss curve."""
    return xs[window - 1:], [statistics.fmean(ys[i - window + 1:i + 1]) for i in range(window - 1, len(ys))]


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


def _line_figure(path: Path, by_method: dict, panels: list[tuple], xlabel: str, title: str,
                 log_y: bool = False, y_from_zero: bool = False) -> bool:
    """Curves of every method, one panel per (key, y label); a shared legend on the right.
    `log_y`: log scale when the values span more than a decade. Returns False
    (and writes nothing) when no panel has a point."""
    if not any(by_method[m][key][0] for m in by_method for key, _ in panels):
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.8, 3.9), layout="constrained",
                             squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], panels):
        for method, curves in by_method.items():
            xs, ys = curves[key]
            if xs:
                ax.plot(xs, ys, label=label(method), marker="o" if len(xs) <= 12 else None,
                        markersize=3.5, **style(method))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        values = [y for m in by_method for y in by_method[m][key][1]]
        if log_y and values and min(values) > 0 and max(values) > 10 * min(values):
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # "+3.3e1" offsets are hard to read
        if y_from_zero:
            ax.set_ylim(0, max(1.0, *values) * 1.05)
    return _finish(fig, axes, path, title)


def _by_method(runs: list[Run], curves: dict) -> dict:
    """{method: {curve name: (xs, ys)}} with `curves` = {name: run → {x: y}}."""
    return {m: {name: _mean_curve([r for r in runs if r.method == m], fn) for name, fn in curves.items()}
            for m in method_order(r.method for r in runs)}


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


def _without_rescorings(runs: list[Run]) -> list[Run]:
    """The runs less each `pflalign rescore` whose source run is among them: a rescoring keeps its
    source's training lines (metrics.jsonl) and config but for `method_args.personalized`, so its
    training curves would be the source's drawn again under another name (and its round_eval
    lines, scored during training, are the source's personalized model, not the rescored one)."""
    def training(r: Run) -> tuple:
        config = {**r.config, "method_args": {k: v for k, v in (r.config.get("method_args") or {}).items()
                                              if k != "personalized"}}
        return r.dataset, r.seed, repr(sorted(flat(config, empty_tables=False).items()))

    sources = {training(r) for r in runs if not r.results.get("rescored_from")}
    return [r for r in runs if not (r.results.get("rescored_from") and training(r) in sources)]


def write_figures(runs: list[Run], tasks: list[str], rows: list[Row], folder: Path,
                  client: str | None = None, paper: bool = False) -> tuple[list[tuple[str, str]], list[str]]:
    """Draw one dataset's figures into `folder`; returns ([(title, file name)], [reasons for skipped ones]).
    `paper`: the runs are of the paper's federations (`report.paper_federation`), whose figures default
    to the paper's client."""
    drawn, skipped = [], []
    if client is not None and client not in tasks:
        skipped.append(f"client {client!r} is not in this dataset ({', '.join(tasks)}); "
                       f"the per-client figures use the default instead")
        client = None
    task = figure_client(tasks, client, paper)
    trained = _without_rescorings(runs)  # the figures of training: each training once

    def of_client(event: str, key: str, x):
        def points(r: Run) -> dict:
            cid = r.client_id(task)
            return {x(r, m): m.get(key) for m in r.events(event) if m.get("client") == cid}
        return points

    by_round = lambda r, m: m["round"] + 1  # noqa: E731
    by_step = lambda r, m: m["round"] * r.config.get("local_steps", 1) + m["step"] + 1  # noqa: E731

    def add(name: str, title: str, draw, why: str) -> None:
        """Draw one figure; a figure without data, or with malformed lines, is skipped with a note."""
        try:
            ok = draw(folder / name)
        except (KeyError, TypeError, ValueError) as exc:
            ok, why = False, f"could not be drawn from the metrics ({type(exc).__name__}: {exc})"
            plt.close("all")
        if ok:
            drawn.append((title, name))
        else:
            skipped.append(f"{title}: {why}")

    def gsnr(path: Path) -> bool:
        curves = _by_method(trained, {"gsnr_mean": of_client("client_round", "gsnr_mean", by_round),
                                   "gsnr_ratio": of_client("client_round", "gsnr_ratio", by_round)})
        return _line_figure(path, curves,
                            [("gsnr_mean", r"mean GSNR$_i$ over coordinates"),
                             ("gsnr_ratio", r"GSNR ratio  $\|\bar g\|^2 \,/\, \Sigma_i\, \mathrm{var}(g_i)$")],
                            "round", f"Gradient signal-to-noise ratio of local minibatch gradients, client {task}",
                            log_y=True)

    def step(path: Path) -> bool:
        def of_clients(key):  # the mean over the round's clients (pFLAlign's own measurements)
            def points(r: Run) -> dict:
                per_round: dict = {}
                for m in r.events("client_round"):
                    if m.get(key) is not None and "round" in m:
                        per_round.setdefault(m["round"] + 1, []).append(m[key])
                return {x: statistics.fmean(v) for x, v in per_round.items()}
            return points

        keys = ("step_ratio", "P_p90", "gamma_mean", "delta_norm")
        curves = _by_method(trained, {key: of_clients(key) for key in keys})
        curves = {m: c for m, c in curves.items() if any(c[key][0] for key in keys)}  # pFLAlign's family only
        return bool(curves) and _line_figure(
            path, curves,
            [("step_ratio", r"$\|P \odot g\| \,/\, \|g\|$ (1: SGD's step)"), ("P_p90", "90th percentile of P"),
             ("gamma_mean", r"mean gate $\gamma$"), ("delta_norm", r"$\|\Delta_k\|$ at the round's start")],
            "round", "What decides pFLAlign's step, mean over clients", log_y=True)

    def loss(path: Path) -> bool:
        curves = _by_method(trained, {"loss": of_client("train_step", "loss", by_step)})
        window = max(r.config.get("local_steps", 1) for r in trained)
        ylabel = "training loss (minibatch)"
        if max(len(c["loss"][0]) for c in curves.values()) > 60 and window > 1:  # many steps: one round's mean
            curves = {m: {"loss": _moving_mean(*c["loss"], window)} for m, c in curves.items()}
            ylabel = f"training loss (mean of the last {window} steps)"
        # log scale once the curves span a decade: a diverged run (FLAN: loss 5–106) then leaves the others readable
        return _line_figure(path, curves, [("loss", ylabel)], "local step (all rounds)",
                            f"Training loss, client {task}", log_y=True)

    def consistency(path: Path) -> bool:
        def of_round(key):
            return lambda r: {m["round"] + 1: m.get(key) for m in r.events("round")}

        # the update-norm variant only: the model norm is dominated by LoRA's random A (docs/usage.md)
        curves = _by_method(trained, {"update": of_round("consistency_update_norm")})
        return _line_figure(path, curves,
                            [("update", r"$\Sigma_k\, p_k \|w_k^{r+1} - w^r\|$ (lower: more consistent)")],
                            "round", r"Aggregation consistency, $p_k = |D_k| \,/\, \Sigma_j |D_j|$", log_y=True)

    def bars(path: Path) -> bool:
        if len(tasks) > MAX_BAR_CLIENTS:
            return False
        _rouge_bars(path, tasks, rows)
        return True

    # what the per-round scores were computed on: eval.every_max_test may or may not cut the test split
    scored = sorted({m["n_test"] for r in trained for m in r.events("round_eval") if m.get("n_test")})
    on = ""
    if scored:
        count = str(scored[0]) if len(scored) == 1 else f"{scored[0]}–{scored[-1]}"
        on = f" on {count} test {'example' if scored == [1] else 'examples'} per client"

    def rouge_rounds(path: Path) -> bool:
        def eval_mean(key):
            def points(r: Run) -> dict:
                per_round: dict = {}
                for m in r.events("round_eval"):
                    per_round.setdefault(m["round"] + 1, []).append(m[key])
                return {x: statistics.fmean(v) for x, v in per_round.items()}
            return points

        curves = _by_method(trained, {"personalized": eval_mean("rouge_l_personalized"),
                                   "global": eval_mean("rouge_l_global")})
        return _line_figure(path, curves,
                            [("personalized", "personalized ROUGE-L, mean over clients"),
                             ("global", "global ROUGE-L, mean over clients")],
                            "round", f"ROUGE-L over rounds (eval.every){on}",
                            y_from_zero=True)

    if sweeps(rows):  # most reports hold no sweep: no note for a figure nobody asked for
        add("sweeps.png", "Sweeps: Avg against the swept setting", lambda p: _sweeps_figure(p, rows), "")
    add("gsnr.png", f"GSNR over rounds, client {task}", gsnr, "no GSNR values (it needs local_steps ≥ 2)")
    add("step.png", "pFLAlign's step: preconditioner, gate and personal offset over rounds", step,
        "no run logged pFLAlign's step measurements (runs of pFLAlign or its variants since issue 38)")
    add("loss.png", f"Training loss over local steps, client {task}", loss, "no train_step lines")
    add("consistency.png", "Aggregation consistency over rounds", consistency,
        "no consistency values in the round lines")
    add("rouge_clients.png", "Personalized ROUGE-L per client", bars,
        f"{len(tasks)} clients are more than {MAX_BAR_CLIENTS} bars can show; see the scatter")
    add("rouge_scatter.png", "Per-client ROUGE-L, personalized vs global", lambda p: _rouge_scatter(p, runs),
        "no client has both a personalized and a global score")
    add("rouge_rounds.png", f"ROUGE-L over rounds{on or ' (test subsample)'}", rouge_rounds,
        "no round_eval lines (runs made without eval.every)")
    return drawn, skipped
