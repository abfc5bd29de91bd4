"""Finished runs read back for `pflalign report` (`find_runs`, `Run`): their results, metrics and
predictions, whether a run (or one of its clients) diverged, its training dynamics and GSNR, and
which of the paper's federations it is (`paper_federation`). No training code is imported."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .. import checkpoint as ckpt
from ..data.dolly import PAPER_CATEGORIES as DOLLY_PAPER_CATEGORIES
from ..data.flan import PAPER_CATEGORIES as FLAN_PAPER_CATEGORIES
from ..errors import UserError
from ..methods import label, method_order
from ..run_stats import DIVERGED_LOSS_RATIO, client_blowups, start_loss


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


def predictions(run: Run) -> list[dict]:
    """The run's predictions.jsonl rows ([] when it has none or it cannot be read as JSON lines)."""
    try:
        text = ckpt.read_stored_text(run.path / ckpt.PREDICTIONS)  # or its gzipped committed copy
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError):
        return []


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
