"""The tables of `pflalign report`, from the runs (`runs.py`) and their statistics (`stats.py`): Table 1
(`summarize` → `Row`s, `table_markdown`, `write_table_csv`), the sweeps, run time, the spread over
clients, the answers' distribution, paired differences, training dynamics and GSNR, as markdown."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..methods import family, label, method_order
from ..run_stats import client_blowups, distribution
from .runs import GSNR_RISE_ROUND, Run, client_gsnr, divergence, predictions, run_dynamics
from .stats import REFERENCE, Paired, ci95_half_width


@dataclass
class Row:
    method: str
    seeds: list[int]
    cells: dict[str, float]  # task → mean over seeds
    cell_ci: dict[str, float | None]
    avg: float
    avg_ci: float | None
    diverged_seeds: list[int] = field(default_factory=list)  # runs whose training diverged (`divergence`)
    # runs that did not, in which a client's training blew up for a while (`client_blowup_notes`)
    client_blowup_seeds: list[int] = field(default_factory=list)
    # the untrained base model's Avg on the same runs' test sets, mean over the seeds that scored it
    # (eval.base_model); None where none did
    base_avg: float | None = None
    family: str = field(init=False)

    def __post_init__(self):
        self.family = family(self.method)


METRICS = {"rouge_l": "ROUGE-L", "exact_match": "exact match"}


def summarize(runs: list[Run], metric: str = "rouge_l") -> tuple[list[str], list[Row]]:
    """One dataset's runs → (client columns by task, rows in table order); cells are the
    personalized `metric` (rouge_l or exact_match)."""
    tasks: list[str] = []
    for r in runs:
        tasks += [t for t in r.tasks if t not in tasks]
    rows = []
    for method in method_order(r.method for r in runs):
        mine = [r for r in runs if r.method == method]
        per_task = {t: [c[f"{metric}_personalized"] for r in mine for c in r.results["clients"]
                        if c["task"] == t and c.get(f"{metric}_personalized") is not None]
                    for t in tasks}
        avgs = [r.results[f"avg_{metric}_personalized"] for r in mine
                if r.results.get(f"avg_{metric}_personalized") is not None]
        if not avgs:
            continue
        rows.append(Row(
            method, sorted(r.seed for r in mine),
            {t: statistics.fmean(v) for t, v in per_task.items() if v},
            {t: ci95_half_width(v) for t, v in per_task.items() if v},
            statistics.fmean(avgs), ci95_half_width(avgs),
            sorted(r.seed for r in mine if divergence(r) is not None),
            sorted(r.seed for r in mine if divergence(r) is None and client_blowups(r.metrics)),
            _mean_or_none([r.results.get(f"avg_{metric}_base") for r in mine]),
        ))
    return tasks, rows


def _mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


# Best/second marks compare means over seeds: a row of one seed takes no part (its order against
# another row is what a rerun can change: issue 56's short runs marked differences of 0.2 points)
MARK_SEEDS = 2


def _ranks(values: list[float | None]) -> list[int | None]:
    """1 for the best (highest) shown value, 2 for the second, None otherwise; ties share a rank.
    A column where every row shows the same value gets no marks."""
    shown = sorted({round(v, 2) for v in values if v is not None}, reverse=True)
    if len(shown) < 2:
        return [None] * len(values)
    return [shown.index(round(v, 2)) + 1 if v is not None and shown.index(round(v, 2)) < 2 else None
            for v in values]


def marked(rows: list[Row]) -> bool:
    """Whether a table of these rows gets best/second marks: two rows of `MARK_SEEDS` seeds or more."""
    return sum(len(row.seeds) >= MARK_SEEDS for row in rows) >= 2


def table_markdown(tasks: list[str], rows: list[Row], families: bool = True) -> str:
    """Table 1 in markdown: family headings (the paper's grouping; `families`), best per column
    bold, second underlined among the rows of `MARK_SEEDS` seeds or more, † after a method with a
    diverged run, ‡ after one with a run in which a client blew up (and the run did not diverge);
    a Base column (the untrained base model's Avg, unmarked) where the runs scored it, so that a
    method whose Avg sits at the base model's is seen not to have trained."""
    judged = [len(row.seeds) >= MARK_SEEDS for row in rows]
    columns = [[row.cells.get(t) if ok else None for row, ok in zip(rows, judged)] for t in tasks] \
        + [[row.avg if ok else None for row, ok in zip(rows, judged)]]
    ranks = [_ranks(col) for col in columns]
    base = any(row.base_avg is not None for row in rows)

    def mark(text: str, rank: int | None) -> str:
        return f"**{text}**" if rank == 1 else f"<u>{text}</u>" if rank == 2 else text

    lines = ["| Method | " + " | ".join(tasks) + " | Avg |" + (" Base |" if base else ""),
             "| :-- | " + " | ".join("--:" for _ in tasks) + " | --: |" + (" --: |" if base else "")]
    heading = None
    for i, row in enumerate(rows):
        if families and row.family != heading:
            heading = row.family
            lines.append(f"| *{heading}* |" + " |" * (len(tasks) + 1 + base))
        cells = [mark(f"{row.cells[t]:.2f}", ranks[j][i]) if t in row.cells else "–" for j, t in enumerate(tasks)]
        avg = f"{row.avg:.2f}" + (f" ± {row.avg_ci:.2f}" if row.avg_ci is not None else "")
        cells.append(mark(avg, ranks[-1][i]))
        if base:
            cells.append("–" if row.base_avg is None else f"{row.base_avg:.2f}")
        dagger = (" †" if row.diverged_seeds else "") + (" ‡" if row.client_blowup_seeds else "")
        lines.append(f"| {label(row.method)}{dagger} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table_csv(path: Path, tasks: list[str], rows: list[Row]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "family", *tasks, "avg", "avg_ci95", "n_seeds", "seeds", "diverged_seeds",
                    "client_blowup_seeds", "base_avg"])
        for row in rows:
            w.writerow([row.method, row.family,
                        *(f"{row.cells[t]:.4f}" if t in row.cells else "" for t in tasks),
                        f"{row.avg:.4f}", "" if row.avg_ci is None else f"{row.avg_ci:.4f}",
                        len(row.seeds), " ".join(map(str, row.seeds)), " ".join(map(str, row.diverged_seeds)),
                        " ".join(map(str, row.client_blowup_seeds)),
                        "" if row.base_avg is None else f"{row.base_avg:.4f}"])


@dataclass
class Sweep:
    """A grid's line: the rows whose names differ in one numeric setting only
    (`fedavg@lr=0.005`, `fedavg@lr=0.01`, ...), by value."""

    name: str  # the rows' name without the swept setting: "fedavg", "pflalign@beta=0.5"
    setting: str  # "lr"
    points: list[tuple[float, Row]]

    def best(self) -> float | None:
        """The value with the highest Avg as the table shows it (two decimals) among the rows
        none of whose seeds diverged; a tie goes to the smaller value (the rule issue 38 fixed
        before its validation grid ran). None when every row diverged."""
        kept = [(round(row.avg, 2), -value, value) for value, row in self.points if not row.diverged_seeds]
        return max(kept)[2] if kept else None


def _setting_value(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def sweeps(rows: list[Row]) -> list[Sweep]:
    """Every numeric setting of a grid-point name (method@k=v,...) that takes two values or more
    among rows alike in everything else; rows named without arguments join none."""
    groups: dict[tuple[str, str], list[tuple[float, Row]]] = {}
    for row in rows:
        base, _, args = row.method.partition("@")
        settings = dict(a.partition("=")[::2] for a in args.split(",")) if args else {}
        for key, text in settings.items():
            value = _setting_value(text)
            if value is None:
                continue
            rest = ",".join(f"{k}={v}" for k, v in settings.items() if k != key)
            groups.setdefault((base + (f"@{rest}" if rest else ""), key), []).append((value, row))
    order = method_order(name for name, _ in groups)
    return [Sweep(name, key, sorted(points, key=lambda p: p[0]))
            for (name, key), points in sorted(groups.items(), key=lambda g: (order.index(g[0][0]), g[0][1]))
            if len({v for v, _ in points}) >= 2]


def sweeps_markdown(found: list[Sweep]) -> str:
    """One table per swept setting: a row per sweep, its Avg at each value, and its best value."""
    out = []
    for setting in dict.fromkeys(s.setting for s in found):
        mine = [s for s in found if s.setting == setting]
        values = sorted({v for s in mine for v, _ in s.points})
        lines = ["| Method | " + " | ".join(f"{setting}={v:g}" for v in values) + f" | best {setting} |",
                 "| :-- | " + " | ".join("--:" for _ in values) + " | --: |"]
        for s in mine:
            at = {v: row for v, row in s.points}
            best = s.best()

            def cell(v: float) -> str:
                if v not in at:
                    return "–"
                text = f"{at[v].avg:.2f}" + (" †" if at[v].diverged_seeds else "")
                return f"**{text}**" if v == best else text

            lines.append(f"| {label(s.name)} | " + " | ".join(cell(v) for v in values)
                         + f" | {'–' if best is None else f'{best:g}'} |")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def _seed_note(rows: list[Row]) -> str:
    counts = {len(r.seeds) for r in rows}
    if len(counts) == 1:
        n = counts.pop()
        return f"mean over {n} seed{'s' if n > 1 else ''}" + ("" if n > 1 else " (no confidence interval)")
    return "mean over seeds (" + ", ".join(f"{label(r.method)}: {len(r.seeds)}" for r in rows) + ")"


def cost_markdown(runs: list[Run]) -> str:
    """Run time per method, means over its runs: from the `round` lines (training, every
    round, also across resumes) and `results.json` (the final evaluation)."""
    lines = ["| Method | runs | s / round | training s / run | final eval s / run |",
             "| :-- | --: | --: | --: | --: |"]
    for method in method_order(r.method for r in runs):
        mine = [r for r in runs if r.method == method]
        rounds = [[m["seconds"] for m in r.events("round") if "seconds" in m] for r in mine]
        per_round = [x for rs in rounds for x in rs]
        evals = [r.results["seconds_eval"] for r in mine if "seconds_eval" in r.results]
        fmt = lambda v: f"{statistics.fmean(v):.1f}" if v else "–"  # noqa: E731
        lines.append(f"| {label(method)} | {len(mine)} | {fmt(per_round)} | {fmt([sum(rs) for rs in rounds if rs])} "
                     f"| {fmt(evals)} |")
    return "\n".join(lines) + "\n"


MAX_TABLE_CLIENTS = 12  # more clients than this: Table 1 shows the average only (the CSV keeps every client)


def distribution_markdown(runs: list[Run]) -> str:
    """How ROUGE-L spreads over a run's scored clients, mean over each method's runs: the plain mean,
    the |D_k|-weighted mean and the mean of the worst 10% of clients, personalized and global
    (`run_stats.distribution`, computed from results.json's clients, so older runs have it too)."""

    lines = ["| Method | clients | pers. mean | pers. weighted | pers. worst 10% | glob. mean | glob. weighted "
             "| glob. worst 10% |", "| :-- | --: | --: | --: | --: | --: | --: | --: |"]
    for method in method_order(r.method for r in runs):
        mine = [r for r in runs if r.method == method]
        dists = {kind: [d for r in mine if (d := distribution(r.results["clients"], f"rouge_l_{kind}")) is not None]
                 for kind in ("personalized", "global")}

        def cell(kind: str, key: str) -> str:
            values = [d[key] for d in dists[kind]]
            return f"{statistics.fmean(values):.2f}" if values else "–"

        clients = [d["clients"] for d in dists["personalized"]]
        lines.append(f"| {label(method)} | {round(statistics.fmean(clients)) if clients else '–'} | "
                     + " | ".join(cell(k, key) for k in ("personalized", "global")
                                  for key in ("mean", "weighted_mean", "worst_10pct_mean")) + " |")
    return "\n".join(lines) + "\n"


def top_answer(answers: list[str]) -> tuple[str, float]:
    """The most common answer (after `evaluate.normalize_answer`; ties: the first seen) and its share."""
    from collections import Counter

    from ..evaluate import normalize_answer

    counts = Counter(normalize_answer(a) for a in answers)
    answer, n = counts.most_common(1)[0]
    return answer, n / len(answers)


def _short(answer: str, width: int = 24) -> str:
    return repr(answer if len(answer) <= width else answer[:width - 1] + "…")


def answers_markdown(runs: list[Run], tasks: list[str]) -> str | None:
    """Per client, the share of the test examples that got the personalized model's most common
    answer (mean over seeds), under a first row with the most common reference and the ROUGE-L
    ×100 of giving it to every example. None when no run has predictions."""
    from ..evaluate import rouge_l

    rows = {r.path: predictions(r) for r in runs}
    if not any(rows.values()):
        return None
    majority = []
    for task in tasks:
        scores, common = [], None
        for r in runs:
            refs = [p["reference"] for p in rows[r.path] if p.get("task") == task]
            if refs:
                answer, _ = top_answer(refs)
                common = common or answer
                scores.append(rouge_l([answer] * len(refs), refs))
        majority.append(f"{_short(common)}: {statistics.fmean(scores):.2f}" if scores else "–")
    lines = ["| Method | " + " | ".join(tasks) + " |", "| :-- | " + " | ".join("--:" for _ in tasks) + " |",
             "| *most common reference: ROUGE-L of answering it to all* | " + " | ".join(majority) + " |"]
    for method in method_order(r.method for r in runs):
        cells = []
        for task in tasks:
            tops = [top_answer(outs) for r in runs if r.method == method
                    if (outs := [p["personalized"] for p in rows[r.path]
                                 if p.get("task") == task and isinstance(p.get("personalized"), str)])]
            if not tops:
                cells.append("–")
                continue
            share = statistics.fmean(t[1] for t in tops)
            same = len({t[0] for t in tops}) == 1 and share >= 0.5  # one answer, the same in every seed
            cells.append(f"{100 * share:.0f}%" + (f" {_short(tops[0][0])}" if same else ""))
        lines.append(f"| {label(method)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_markdown(tasks: list[str], paired: list[Paired], reference: str = REFERENCE) -> str:
    """One row per baseline: mean difference ± paired 95% CI half-width; * where the interval excludes 0
    and counts (`judgeable`: 3 seeds or more whose differences are not all equal)."""
    lines = ["| " + f"{label(reference)} − | seeds | " + " | ".join(tasks) + " | Avg |",
             "| :-- | --: | " + " | ".join("--:" for _ in tasks) + " | --: |"]
    for p in paired:
        cells = []
        for task in [*tasks, None]:
            mean, ci = p.mean(task), p.ci(task)
            if mean is None:
                cells.append("–")
                continue
            text = f"{mean:+.2f}" + (f" ± {ci:.2f}" if ci is not None else "")
            cells.append(text + ("*" if p.significant(task) else ""))
        lines.append(f"| {label(p.method)} | {len(p.seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def dynamics_markdown(runs: list[Run]) -> str:
    """Per method, means over seeds (± 95% CI) of `run_dynamics`: the aggregation consistency
    (update norm) of the last round and over all rounds, and the GSNR ratio (mean over clients)
    of the first and last round."""
    keys = ["cons_last", "cons_mean", "gsnr_first", "gsnr_last"]
    lines = ["| Method | consistency, last round | consistency, mean over rounds | GSNR ratio, first round "
             "| GSNR ratio, last round |", "| :-- | --: | --: | --: | --: |"]
    return "\n".join(lines + _mean_rows(runs, run_dynamics, keys)) + "\n"


def _mean_rows(runs: list[Run], per_run, keys: list[str]) -> list[str]:
    """One table row per method: for each key, `per_run`'s values averaged over the method's runs."""
    rows = []
    for method in method_order(r.method for r in runs):
        stats = [per_run(r) for r in runs if r.method == method]
        rows.append(f"| {label(method)} | " + " | ".join(_mean_cell([s[k] for s in stats]) for k in keys) + " |")
    return rows


def _mean_cell(values: list) -> str:
    """Mean over seeds, 3 significant digits, ± the 95% CI half-width; – without values."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    ci = ci95_half_width(values)
    return f"{statistics.fmean(values):.3g}" + (f" ± {ci:.2g}" if ci is not None else "")


def client_gsnr_markdown(runs: list[Run], task: str) -> str:
    """Per method, `client_gsnr` of one client (the GSNR figure's): means over seeds ± 95% CI."""
    keys = ["first", "rise_round", "last", "change"]
    lines = [f"| Method | round 1 | round {GSNR_RISE_ROUND} | last round | change, round 1 → {GSNR_RISE_ROUND} |",
             "| :-- | --: | --: | --: | --: |"]
    return "\n".join(lines + _mean_rows(runs, lambda r: client_gsnr(r, task), keys)) + "\n"
