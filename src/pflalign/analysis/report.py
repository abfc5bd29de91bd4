"""`pflalign report`: the paper's Table 1 and the statistics of finished runs.

Scans a folder for finished runs (a directory with `results.json`,
`metrics.jsonl` and `config.json`), groups them by dataset and method, and
computes per dataset a table shaped like the paper's Table 1 (`table.md`,
`table.csv`), paired differences, training dynamics and their markdown;
`report_md.write_report` puts them, the figures (`analysis/figures.py`) and the
claims (`analysis/claims.py`) into one `report.md`: figures and claims read this
module's rows, and it imports neither (tests/test_layers.py). A run's dataset is the folder name in a sweep's layout
(<dataset>/<method>/seed<k>/), else its `results.json` dataset.

Cells are personalized ROUGE-L ×100, the mean over seeds; the Avg column is
the mean over seeds of each run's client average, ± the half-width of the 95%
Student-t confidence interval over seeds, t_{0.975, n−1} · s / √n.

The paper's own parts (Table 1's family headings, the claims, structure_to_text
as the figures' default client) are for its federations only (`paper_federation`);
other data get a neutral report.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .. import checkpoint as ckpt
from ..errors import UserError
from ..data.load import DOLLY_PAPER_CATEGORIES, FLAN_PAPER_CATEGORIES
from ..methods import FAMILIES, family, label, method_order  # noqa: F401  (FAMILIES: the table's row groups)
from ..run_stats import DIVERGED_LOSS_RATIO, client_blowups, distribution, start_loss


# ---- statistics -------------------------------------------------------------
def _t_central_mass(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with integer df (Abramowitz & Stegun 26.7.3–4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for k in range(2, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        return math.sin(theta) * total
    total = theta
    if df > 1:
        term = math.sin(theta) * math.cos(theta)
        total += term
        for k in range(3, df - 1, 2):
            term *= c2 * (k - 1) / k
            total += term
    return 2 / math.pi * total


def t_quantile(p: float, df: int) -> float:
    """t_{p, df}: the p-quantile of Student's t (p > 0.5), by bisection on the exact CDF."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError(f"need df >= 1 and 0.5 < p < 1, got df={df}, p={p}")
    mass = 2 * p - 1
    lo, hi = 0.0, 1.0
    while _t_central_mass(hi, df) < mass:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if _t_central_mass(mid, df) < mass:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2


def ci95_half_width(values: list[float]) -> float | None:
    """Half-width of the 95% confidence interval of the mean, t_{0.975, n−1} · s / √n (None for n < 2)."""
    n = len(values)
    if n < 2:
        return None
    return t_quantile(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)


MIN_SEEDS_TO_JUDGE = 3  # fewest values whose 95% interval counts as evidence (a * mark, a claim's interval)


def judgeable(values: list[float]) -> bool:
    """Whether the 95% interval over `values` may be read as evidence: MIN_SEEDS_TO_JUDGE values or
    more, not all equal. From 2 values s rests on one difference, so the interval's coverage hangs
    on that one draw; values that are all equal give s = 0, an interval of width 0 that "excludes"
    every other value, and they happen (scores on a label task move in steps: 2 seeds whose
    differences are both −16.67 read "−16.67 ± 0.00*"). The interval is still shown."""
    return len(values) >= MIN_SEEDS_TO_JUDGE and max(values) - min(values) > 1e-9


def excludes_zero(values: list[float]) -> bool:
    """The 95% interval of the mean of `values` lies clear of 0, judged only where `judgeable`."""
    return judgeable(values) and abs(statistics.fmean(values)) > ci95_half_width(values)


# ---- finding runs -----------------------------------------------------------
@dataclass
class Run:
    """One finished run as the report sees it."""

    path: Path
    dataset: str
    method: str
    seed: int
    results: dict
    config: dict
    metrics: list[dict]

    @property
    def tasks(self) -> list[str]:
        return [c["task"] for c in self.results["clients"]]

    def events(self, event: str) -> list[dict]:
        return [m for m in self.metrics if m.get("event") == event]

    def client_id(self, task: str) -> int | None:
        return next((c["id"] for c in self.results["clients"] if c["task"] == task), None)


DEFAULT_CLIENT = "structure_to_text"  # the client of the paper's GSNR figure (FLAN)
PAPER_FEDERATIONS = {"flan": FLAN_PAPER_CATEGORIES, "dolly": DOLLY_PAPER_CATEGORIES}


def paper_federation(runs: list[Run]) -> str | None:
    """"flan" or "dolly" when every run is of that paper federation (FedDPA's, as the paper splits
    it): `data.name`, the natural partition (one client per category) and the paper's 4 categories
    as the clients. Only then does the report add the paper's parts: Table 1's family headings,
    the claims, structure_to_text as the default client of the figures. None otherwise (your own
    files, a Dirichlet split of FLAN, other categories): a neutral report."""
    found = set()
    for r in runs:
        data = r.config.get("data")
        data = data if isinstance(data, dict) else {}
        name = data.get("name")
        if (name not in PAPER_FEDERATIONS or data.get("partition", "natural") != "natural"
                or sorted(r.tasks) != sorted(PAPER_FEDERATIONS[name])):
            return None
        found.add(name)
    return found.pop() if len(found) == 1 else None


def figure_client(tasks: list[str], client: str | None, paper: bool) -> str:
    """The client of the per-client figures and of the GSNR table: `client` where the dataset has
    it, else (for the paper's federations, `paper`) DEFAULT_CLIENT where it has that, else the first."""
    if client in tasks:
        return client
    return DEFAULT_CLIENT if paper and DEFAULT_CLIENT in tasks else tasks[0]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_results(path: Path) -> dict:
    """A finished run's results.json, checked for what the tables use; a `UserError` saying
    what is wrong otherwise (truncated, not UTF-8, no clients, null scores, ...)."""
    try:
        results = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (truncated?): {exc}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if not isinstance(results, dict):
        raise UserError(f"{path}: expected a JSON object, got a {type(results).__name__}")
    if not isinstance(results.get("method"), str) or not isinstance(results.get("seed"), int):
        raise UserError(f"{path}: no method or seed")
    clients = results.get("clients")
    if not isinstance(clients, list) or not clients:
        raise UserError(f"{path}: no clients")
    for i, c in enumerate(clients):
        if not isinstance(c, dict) or not isinstance(c.get("task"), str):
            raise UserError(f"{path}: client {i} has no task")
        if not _number(c.get("rouge_l_personalized")):
            raise UserError(f"{path}: client {i} ({c['task']}) has no personalized score "
                            f"(got {c.get('rouge_l_personalized')!r})")
    if not _number(results.get("avg_rouge_l_personalized")):
        raise UserError(f"{path}: no average personalized score (got {results.get('avg_rouge_l_personalized')!r})")
    return results


def _unfinished_notes(root: Path) -> list[str]:
    """Run folders under `root` without results.json: a half-finished sweep's runs."""
    notes = []
    for config_path in sorted(root.rglob(ckpt.CONFIG)):
        d = config_path.parent
        if (d / ckpt.RESULTS).exists():
            continue
        try:
            saved = json.loads(config_path.read_text())
            if not isinstance(saved, dict) or "method" not in saved or "rounds" not in saved:
                continue  # not a pflalign run folder (a model's config.json, ...)
        except (OSError, ValueError):
            notes.append(f"{d}: left out, unfinished and its config.json is unreadable")
            continue
        rounds = None
        try:
            entries = json.loads((d / ckpt.MANIFEST).read_text())["checkpoints"]
            rounds = max(e["rounds_done"] for e in entries if isinstance(e.get("rounds_done"), int))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        where = f"checkpoint after round {rounds} of {saved['rounds']}" if rounds is not None else "no checkpoint yet"
        notes.append(f"{d}: left out, unfinished ({where})")
    return notes


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    """Every finished run under `root`, and a note for each directory left out."""
    runs, notes = [], []
    for results_path in sorted(root.rglob(ckpt.RESULTS)):
        d = results_path.parent
        missing = [n for n in (ckpt.METRICS, ckpt.CONFIG) if not ckpt.stored(d / n).exists()]
        if missing:
            notes.append(f"{d}: left out, no {' or '.join(missing)}")
            continue
        try:
            results = read_results(results_path)
            config = json.loads((d / ckpt.CONFIG).read_bytes().decode("utf-8"))
            method, seed = results["method"], results["seed"]
        except UserError as exc:
            notes.append(f"{d}: left out, {exc}")
            continue
        except (ValueError, KeyError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            notes.append(f"{d}: left out, unreadable results/config ({exc})")
            continue
        rel = d.relative_to(root).parts
        in_layout = len(rel) >= 3 and (rel[-2] == method or rel[-2].startswith(method + "@"))
        if in_layout:
            method = rel[-2]  # a sweep's grid point keeps its own row
        dataset = rel[-3] if in_layout else results.get("dataset", "runs")
        runs.append(Run(d, dataset, method, seed, results, config, list(ckpt.metrics_rows(d / ckpt.METRICS))))
    return runs, notes + _unfinished_notes(root)


# ---- runs whose training diverged ---------------------------------------------
@dataclass
class Divergence:
    """A run whose last round ended with more than DIVERGED_LOSS_RATIO × the training loss it started
    from (`run_stats.start_loss`)."""

    from_round: int  # 1-based (as the run's log): the first of the final rounds that stayed above the start
    start_loss: float
    last_loss: float


def round_losses(run: Run) -> list[tuple[int, float]]:
    """(round, mean training loss) from the run's `round` lines (the mean over its clients' local
    steps), in round order; rounds are 0-based, as in metrics.jsonl."""
    rounds = {m["round"]: m["mean_loss"] for m in run.events("round")
              if isinstance(m.get("round"), int) and _number(m.get("mean_loss"))}
    return sorted(rounds.items())


def divergence(run: Run) -> Divergence | None:
    """How the run diverged, or None when its last round's mean training loss is at most
    DIVERGED_LOSS_RATIO × the loss it started from.

    Why a ratio (2, run_stats.py says where it comes from) and not "above the start": a run that barely
    learns (pFLAlign at β = 0.99, a 2-round toy) ends near 1 ×, above it by noise. The scores of a
    diverged run are real, but they measure the blow-up."""
    rounds = round_losses(run)
    start = start_loss(run.metrics)
    if len(rounds) < 2 or start is None or rounds[-1][1] <= DIVERGED_LOSS_RATIO * start:
        return None
    i = len(rounds) - 1
    while i > 0 and rounds[i - 1][1] > start:
        i -= 1
    return Divergence(rounds[i][0] + 1, start, rounds[-1][1])


def divergence_notes(runs: list[Run]) -> list[str]:
    """One line per diverged run, in table order."""
    notes = []
    for method in method_order(r.method for r in runs):
        for r in sorted((r for r in runs if r.method == method), key=lambda r: r.seed):
            d = divergence(r)
            if d is not None:
                notes.append(f"{label(method)} seed {r.seed}: mean training loss {d.start_loss:.3g} at the start "
                             f"(round 1's first steps), above "
                             f"it from round {d.from_round} on, {d.last_loss:.3g} in the last round "
                             f"({d.last_loss / d.start_loss:.1f} ×)")
    return notes


def client_blowup_notes(runs: list[Run]) -> list[str]:
    """One line per run, in table order, that did not diverge as a run (`divergence`) but in which a
    client's training blew up for a while (`run_stats.client_blowups`): the run's mean hid it."""
    notes = []
    for method in method_order(r.method for r in runs):
        for r in sorted((r for r in runs if r.method == method), key=lambda r: r.seed):
            found = client_blowups(r.metrics) if divergence(r) is None else []
            if found:
                tasks = {c["id"]: c["task"] for c in r.results.get("clients", [])}
                notes.append(f"{label(method)} seed {r.seed}: " + "; ".join(
                    f"{tasks.get(b.client, f'client {b.client}')} {b.start:.3g} early (its first round's median), "
                    f"{b.peak:.4g} in round {b.peak_round} ({b.peak / b.start:.0f} ×), {b.last:.3g} in its last round"
                    for b in found))
    return notes


# ---- the table --------------------------------------------------------------
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


def with_exact_match(run: Run) -> Run:
    """`run` with exact match in its results, computed from its predictions.jsonl when results.json
    predates it (in memory only; a run without readable predictions keeps None)."""
    if "avg_exact_match_personalized" in run.results:
        return run
    from ..evaluate import add_exact_match

    rows = predictions(run)
    if rows:
        add_exact_match(run.results, rows)
    else:
        for c in run.results["clients"]:
            c["exact_match_personalized"] = None
        run.results["avg_exact_match_personalized"] = None
    return run


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


# ---- sweeps: rows that differ in one setting -----------------------------------
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


# ---- the distribution over clients --------------------------------------------
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


# ---- one answer for every example ----------------------------------------------
def predictions(run: Run) -> list[dict]:
    """The run's predictions.jsonl rows ([] when it has none or it cannot be read as JSON lines)."""
    try:
        text = ckpt.read_stored_text(run.path / ckpt.PREDICTIONS)  # or its gzipped committed copy
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError):
        return []


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


# ---- paired comparisons -------------------------------------------------------
REFERENCE = "pflalign"


def _score(run: Run, task: str | None, metric: str = "rouge_l") -> float | None:
    """A run's personalized `metric` on one client (by task), or its client average (task None)."""
    if task is None:
        return run.results.get(f"avg_{metric}_personalized")
    return next((c.get(f"{metric}_personalized") for c in run.results["clients"] if c["task"] == task), None)


@dataclass
class Paired:
    """Reference minus one baseline over the seeds both ran: mean difference and its paired 95% CI."""

    method: str
    seeds: list[int]
    diffs: dict[str | None, list[float]]  # task (None: the client average) → per-seed differences

    def mean(self, task: str | None) -> float | None:
        return statistics.fmean(self.diffs[task]) if self.diffs.get(task) else None

    def ci(self, task: str | None) -> float | None:
        return ci95_half_width(self.diffs.get(task, []))

    def judged(self, task: str | None) -> bool:
        """Enough seeds, with some spread, for the interval to count (`judgeable`)."""
        return judgeable(self.diffs.get(task, []))

    def significant(self, task: str | None) -> bool:
        """The paired 95% interval excludes 0, where it counts (`excludes_zero`)."""
        return excludes_zero(self.diffs.get(task, []))


def paired_differences(tasks: list[str], runs: list[Run], reference: str = REFERENCE,
                       metric: str = "rouge_l") -> list[Paired]:
    """For each other method, `reference` − method per seed (the seeds share the data split and the
    initial adapter, so the differences are paired), per client and on the client average."""
    ref = {r.seed: r for r in runs if r.method == reference}
    out = []
    for method in method_order(r.method for r in runs):
        if method == reference:
            continue
        pairs = sorted(((ref[r.seed], r) for r in runs if r.method == method and r.seed in ref),
                       key=lambda p: p[1].seed)
        if not pairs:
            continue
        diffs: dict[str | None, list[float]] = {}
        for task in [*tasks, None]:
            values = [(_score(a, task, metric), _score(b, task, metric)) for a, b in pairs]
            if all(x is not None and y is not None for x, y in values):
                diffs[task] = [x - y for x, y in values]
        out.append(Paired(method, [b.seed for _, b in pairs], diffs))
    return out


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


# ---- training dynamics --------------------------------------------------------
def run_dynamics(r: Run) -> dict:
    """One run's training dynamics: the aggregation consistency (update norm) of the last round
    and its mean over rounds, the GSNR ratio (mean over clients) of the first and last round, and
    the clients' mean update norm ‖w_k − w^r‖ over clients and rounds (None where not logged)."""
    rounds = sorted((m for m in r.events("round") if "round" in m), key=lambda m: m["round"])
    cons = [m["consistency_update_norm"] for m in rounds if m.get("consistency_update_norm") is not None]
    gsnr: dict = {}
    updates = []
    for m in r.events("client_round"):
        if m.get("gsnr_ratio") is not None and "round" in m:
            gsnr.setdefault(m["round"], []).append(m["gsnr_ratio"])
        if m.get("update_norm") is not None:
            updates.append(m["update_norm"])
    first, last = (gsnr[min(gsnr)], gsnr[max(gsnr)]) if gsnr else (None, None)
    return {"cons_last": cons[-1] if cons else None, "cons_mean": statistics.fmean(cons) if cons else None,
            "gsnr_first": statistics.fmean(first) if first else None,
            "gsnr_last": statistics.fmean(last) if last else None,
            "update_norm_mean": statistics.fmean(updates) if updates else None}


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


GSNR_RISE_ROUND = 10  # "pFLAlign's GSNR rises fastest" is read as the change from round 1 to this one


def client_gsnr(r: Run, task: str) -> dict:
    """The GSNR ratio of one client (by task) in round 1, round GSNR_RISE_ROUND and the last
    round (1-based), and its change from round 1 to GSNR_RISE_ROUND (None where not logged)."""
    cid = r.client_id(task)
    ratio = {m["round"] + 1: m["gsnr_ratio"] for m in r.events("client_round")
             if m.get("client") == cid and "round" in m and _number(m.get("gsnr_ratio"))}
    first, rise = ratio.get(1), ratio.get(GSNR_RISE_ROUND)
    return {"first": first, "rise_round": rise, "last": ratio[max(ratio)] if ratio else None,
            "change": rise - first if first is not None and rise is not None else None}


def client_gsnr_markdown(runs: list[Run], task: str) -> str:
    """Per method, `client_gsnr` of one client (the GSNR figure's): means over seeds ± 95% CI."""
    keys = ["first", "rise_round", "last", "change"]
    lines = [f"| Method | round 1 | round {GSNR_RISE_ROUND} | last round | change, round 1 → {GSNR_RISE_ROUND} |",
             "| :-- | --: | --: | --: | --: |"]
    return "\n".join(lines + _mean_rows(runs, lambda r: client_gsnr(r, task), keys)) + "\n"
