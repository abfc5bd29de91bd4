"""The report's figures (matplotlib, Agg backend, PNG), one dataset at a time (`write_figures`).

Every curve is a mean over the method's seeds. The training curves (GSNR, pFLAlign's step, loss,
consistency, ROUGE-L over rounds) are line figures drawn here; the clients' final scores are
`client_figures`' bars and scatter, the sweeps `sweep_figure`'s; every figure looks as
`figure_style` says (each method one colour everywhere). A figure whose data is missing (e.g. no
`round_eval` lines) is skipped and the reason is returned for report.md.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures are drawn without a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..methods import label, method_order  # noqa: E402
from ..settings import flat  # noqa: E402

from .client_figures import MAX_BAR_CLIENTS, _rouge_bars, _rouge_scatter  # noqa: E402
from .figure_style import _finish, style  # noqa: E402
from .runs import figure_client  # noqa: E402  (report does not import this module: report_md does)
from .sweep_figure import _sweeps_figure  # noqa: E402
from .tables import sweeps  # noqa: E402

if TYPE_CHECKING:  # the rows and runs `report` hands in
    from .runs import Run
    from .tables import Row


def _mean_curve(runs: list[Run], points) -> tuple[list, list]:
    """Mean over runs of {x: y} curves (x kept where any run has it)."""
    by_x: dict = {}
    for r in runs:
        for x, y in points(r).items():
            if y is not None:
                by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    return xs, [statistics.fmean(by_x[x]) for x in xs]


def _moving_mean(xs: list, ys: list, window: int) -> tuple[list, list]:
    """Trailing mean over `window` points (from the window-th point on): a readable loss curve."""
    return xs[window - 1:], [statistics.fmean(ys[i - window + 1:i + 1]) for i in range(window - 1, len(ys))]


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
