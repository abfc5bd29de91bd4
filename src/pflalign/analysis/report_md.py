"""`pflalign report`'s report.md: per dataset the Table 1 layout, the distribution over clients,
the figures, paired differences, training dynamics, the paper's claims (on request) and the run
time, from the statistics `pflalign.analysis.report` computes. Above report, figures and claims, which
read report's rows and do not import each other back: no cycle (tests/test_layers.py).
"""

from __future__ import annotations

from pathlib import Path

from .claims import claims_markdown
from ..errors import UserError
from ..run_stats import CLIENT_BLOWUP_RATIO
from .figures import write_figures
from ..data.dolly import PAPER_CATEGORIES as DOLLY_PAPER_CATEGORIES
from ..data.flan import PAPER_CATEGORIES as FLAN_PAPER_CATEGORIES
from ..methods import label, method_order
from ..run_stats import DIVERGED_LOSS_RATIO
from .runs import (paper_federation, divergence_notes, client_blowup_notes, figure_client, find_runs,
    with_exact_match)
from .stats import MIN_SEEDS_TO_JUDGE, REFERENCE, paired_differences
from .tables import (MARK_SEEDS, MAX_TABLE_CLIENTS, METRICS, _seed_note, answers_markdown,
    client_gsnr_markdown, cost_markdown, distribution_markdown, marked, dynamics_markdown, paired_markdown,
    summarize, sweeps, sweeps_markdown, table_markdown, write_table_csv)


def _intervals(rows) -> bool:
    """Whether any row has an interval to show (two seeds or more): a caption promises one only then."""
    return any(len(row.seeds) >= 2 for row in rows)


def _marks_note(rows) -> str:
    if marked(rows):
        return f"Best per column **bold**, second <u>underlined</u>, among the rows of {MARK_SEEDS} seeds or more. "
    return (f"No best/second marks: fewer than two rows have {MARK_SEEDS} seeds or more, and one run's order "
            "against another is what a rerun can change. ")


def write_report(root: Path | str | list[Path | str], out: Path | str, client: str | None = None,
                 metric: str = "rouge_l", paired_against: tuple[str, ...] | None = None, claims: bool = False) -> Path:
    """Tables and figures for every dataset under `root` (a folder, or several: their runs in one
    report, e.g. new runs beside the committed ones they are paired with) into `out`; returns report.md. The tables
    and paired differences show `metric` (rouge_l or exact_match); the figures are ROUGE-L.
    `paired_against`: the methods that each get a table of paired differences (that method minus
    each other one), each of them with a finished run under `root`; None: pFLAlign, where it ran.
    `claims`: judge the paper's claims (`pflalign.analysis.claims`) under each dataset's tables, for the
    paper's federations (`paper_federation`); a dataset of other data gets a line saying why not."""
    if metric not in METRICS:
        raise UserError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    metric_name = METRICS[metric]
    roots = [Path(r) for r in ([root] if isinstance(root, (str, Path)) else root)]
    out = Path(out)
    where = ", ".join(f"`{r}`" for r in roots)
    for r in roots:
        if not r.is_dir():
            raise UserError(f"{r} is not a folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    runs, notes, seen, taken = [], [], {}, set()
    for r in roots:
        found, left = find_runs(r)
        for run in found:
            if run.path.resolve() in taken:
                continue  # a folder given twice (or inside another given one): its runs count once
            taken.add(run.path.resolve())
            first = seen.setdefault((run.dataset, run.method, run.seed), run.path)
            if first != run.path:  # one row's seed twice: which one the table meant would be a guess
                raise UserError(f"{first} and {run.path} are both {run.dataset}/{run.method}/seed{run.seed}; "
                                "give the report one of them")
            runs.append(run)
        notes += [n for n in left if n not in notes]
    if not runs:
        left = f"; left out: {len(notes)} ({notes[0]}{', ...' if len(notes) > 1 else ''})" if notes else ""
        raise UserError(f"no finished runs (results.json + metrics.jsonl + config.json) under "
                        f"{', '.join(map(str, roots))}{left}")
    present = method_order(r.method for r in runs)
    absent = [m for m in paired_against or () if m not in present]
    if absent:
        raise UserError(f"--paired {absent[0]}: no finished run of it under {', '.join(map(str, roots))}; "
                        f"there are {', '.join(present)}")
    if metric == "exact_match":
        runs = [with_exact_match(r) for r in runs]
    lines = ["# pflalign report", "", f"{len(runs)} finished runs under {where}.", ""]
    for dataset in sorted({r.dataset for r in runs}):
        mine = [r for r in runs if r.dataset == dataset]
        folder = out / dataset
        folder.mkdir(parents=True, exist_ok=True)
        tasks, rows = summarize(mine, metric)
        paper = paper_federation(mine)  # the paper's parts (families, claims, default client) only for its data
        many = len(tasks) > MAX_TABLE_CLIENTS
        table = table_markdown([] if many else tasks, rows, families=paper is not None)
        diverged = divergence_notes(mine)
        if diverged:
            table += (f"\n† Diverged: the run's last round ended with a mean training loss above "
                      f"{DIVERGED_LOSS_RATIO:g} × the loss it started from (its clients' first steps in round 1); "
                      "its scores measure the blow-up, not the method at a working setting.\n\n"
                      + "".join(f"- {n}\n" for n in diverged))
        blowups = client_blowup_notes(mine)
        if blowups:
            table += (f"\n‡ A client blew up: in some round its mean local-step loss passed {CLIENT_BLOWUP_RATIO:g} × "
                      "its early level (the median step loss of its first round), though the run did not end "
                      "diverged (†); the run's mean loss hid "
                      "it, and that client's scores measure what was left after it.\n\n"
                      + "".join(f"- {n}\n" for n in blowups))
        (folder / "table.md").write_text(table)
        write_table_csv(folder / "table.csv", tasks, rows)
        lines += [f"## {dataset}", "",
                  f"Personalized {metric_name} ×100, {_seed_note(rows)}"
                  + ("; Avg ± 95% CI half-width (Student's t over seeds). " if _intervals(rows) else ". ")
                  + _marks_note(rows)
                  + ("Base: the untrained base model's Avg on the same test sets. "
                     if any(row.base_avg is not None for row in rows) else "") +
                  f"[table.md]({dataset}/table.md) · [table.csv]({dataset}/table.csv)"
                  + (f" (per-client columns for all {len(tasks)} clients in table.csv)" if many else ""), "", table]
        found = sweeps(rows)
        if found:
            lines += ["### Sweeps", "",
                      f"Avg ({metric_name} ×100, mean over seeds) of the rows that differ in one setting only; "
                      "bold: the best value, the highest Avg as shown among the rows none of whose seeds "
                      "diverged, a tie going to the smaller value. † diverged.", "", sweeps_markdown(found)]
        lines += ["### Distribution over clients", "",
                  "ROUGE-L ×100 over each run's scored clients, mean over seeds: "
                  "plain mean, |D_k|-weighted mean (|D_k|: training examples) and the mean of the worst 10% "
                  "of clients (at least one).", "", distribution_markdown(mine)]
        answers = None if many else answers_markdown(mine, tasks)
        if answers:
            lines += ["### One answer for every example", "",
                      "Share of each client's test examples that got the personalized model's most common answer "
                      "(case and punctuation ignored), mean over seeds, with that answer where it is the same in "
                      "every seed. Near 100% the model gives one answer to everything: on a one-label task its "
                      "ROUGE-L is then that answer's share of the references, whatever else it learned (the first "
                      "row scores the most common reference so).", "", answers]
        rouge_rows = rows if metric == "rouge_l" else summarize(mine)[1]
        figures, skipped = write_figures(mine, tasks, rouge_rows, folder, client, paper=paper is not None)
        for title, filename in figures:
            lines += [f"### {title}", "", f"![{title}]({dataset}/{filename})", ""]
        if skipped:
            lines += ["Notes on the figures:", ""] + [f"- {s}" for s in skipped] + [""]
        for reference in dict.fromkeys(paired_against or (REFERENCE,)):
            paired = paired_differences(tasks, mine, reference, metric)
            if paired:
                title = "Paired differences" + ("" if reference == REFERENCE else f" against {label(reference)}")
                lines += [f"### {title}", "",
                          f"{label(reference)} minus each other method, seed by seed (the seeds share data splits), "
                          f"in {metric_name} ×100: mean ± paired 95% CI half-width (Student's t over the seeds both "
                          f"ran); * where the interval excludes 0, marked only from {MIN_SEEDS_TO_JUDGE} seeds or more "
                          "whose differences are not all equal.", "", paired_markdown(tasks, paired, reference)]
        lines += ["### Training dynamics", "",
                  "Aggregation consistency Σ_k p_k ‖w_k − w^r‖ (the data-weighted size of the clients' updates: "
                  "lower means they moved less from w^r, not that their directions agree) and the "
                  "GSNR ratio ‖mean g‖² / Σ var(g) of the clients' local gradients along their own paths (it also "
                  "rises as steps shrink), " + ("mean over seeds ± 95% CI " if _intervals(rows) else "one seed each ")
                  + "(docs/usage.md has the exact definitions).", "", dynamics_markdown(mine)]
        gsnr_client = figure_client(tasks, client, paper is not None)
        lines += [f"GSNR ratio of client {gsnr_client} (the GSNR figure's), "
                  + ("mean over seeds ± 95% CI:" if _intervals(rows) else "one seed each:"), "",
                  client_gsnr_markdown(mine, gsnr_client)]
        if claims and paper is None:
            lines += [f"(--claims: the paper's claims are about its FLAN and Dolly federations, 4 clients, one per "
                      f"category: {', '.join(FLAN_PAPER_CATEGORIES)}, or {', '.join(DOLLY_PAPER_CATEGORIES)}; "
                      "these runs are not one of them, so they are not judged here.)", ""]
        elif claims:
            rules = ("docs/results/table1-dolly/README.md (\"The rules\")" if paper == "dolly" else
                     "docs/results/table1-flan/README.md (\"The claims to check\")")
            lines += ["### The paper's claims", "",
                      f"Judged by the rules fixed in {rules}, "
                      "on personalized ROUGE-L ×100 whatever the tables show: means over seeds, and paired "
                      "differences with their 95% intervals (Student's t over the seeds both ran).", "",
                      claims_markdown(mine, gsnr_client, paper)]
        lines += ["### Run time", "", "Wall-clock seconds on the machine that made the runs (training per round "
                  "without the optional per-round evaluation; final evaluation of all clients).", "",
                  cost_markdown(mine)]
    if notes:
        lines += ["## Left out", ""] + [f"- {n}" for n in notes] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"
