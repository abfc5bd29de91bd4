"""`pflalign sweep`: a grid of runs (datasets × methods × seeds), one after another.

A sweep config is a TOML or JSON file (or a preset name, `table1-flan`,
`table1-dolly`)::

    methods = ["fedavg", "pflalign"]     # names from `pflalign methods`
    seeds = [0, 1, 2]

    [base]                               # run-config overrides for every run
    rounds = 10

    [method_args.fedprox]                # optional: one method's hyperparameters
    mu = 0.01

    [grid.fedprox]                       # optional: one run per value (per combination)
    mu = [0.001, 0.01, 0.1]              # a method argument, or a run-config key (lr, local_steps,
    lr = [0.01, 0.04]                    # eval.every, ...): the method's arguments come first

    [[datasets]]                         # one or more
    name = "flan"                        # folder under --out; the report's dataset label
    config = "flan-paper"                # optional: run preset or run-config file
    data_dir = "/data/flan"              # optional; --data-dir replaces it
    set = { max_seq_len = 512 }          # optional: overrides for this dataset only

Every run's config is, later winning: defaults ← the dataset's `config` ←
`base` ← the dataset's `set` ← `--set` ← `method_args.<method>` ← method,
seed and data dir of the grid point. All of them are built and checked before
the first run starts, so a typo fails at once and not hours later.

Run k goes to OUT/<dataset>/<method>/seed<seed>/; a grid point of a method
to OUT/<dataset>/<method>@<arg>=<value>[,...]/seed<seed>/, and the report shows
each grid point as its own row. A run with `results.json`
is finished and skipped; one with a checkpoint is resumed; a run directory
made with a different config is refused, so a table never mixes settings.
`--done DIR` names folders of finished runs kept elsewhere in the same layout
(e.g. the small files committed under docs/results/table1-flan/runs): a run
found there with the same config counts as finished, so a fresh machine runs
only what is left (its data folder and device may differ: `data.dir` and `device`
are not compared for such a copy). A run whose training reaches a NaN or Inf stops alone (its last
checkpoint kept) and the sweep goes on; it ends with one line naming such runs, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .config import RunConfig, build_config, load_config_source, to_dict
from .settings import check_method_name, flat, merge
from .errors import TrainingDiverged, UserError

# checkpoint, the methods and the report load torch (seconds, more under load): each is imported
# where it is used, after the sweep file's method names are checked, so a typo there is refused
# at once (issue 42).

# The paper's Table 1 (its LLaMA rows: both families of baselines and pFLAlign), plus
# `local`, no collaboration at all, the first thing a pFL reader asks about.
TABLE1_METHODS = ["ffa-lora", "fedsa-lora", "fedsvd", "fedavg", "fedprox", "fedsam", "scaffold", "feddyn",
                  "fedyogi", "local", "pflalign"]

SWEEP_PRESETS: dict[str, dict] = {
    "table1-flan": {"methods": TABLE1_METHODS, "seeds": [0, 1, 2],
                    "datasets": [{"name": "flan", "config": "flan-paper"}],
                    # chosen by the `tune-flan` sweep on FLAN's validation split (docs/methods.md,
                    # docs/results/tune-flan), then kept only if seed 0 at this protocol does not
                    # diverge. FedDyn α = 0.01, then 0.001, and FedYogi (0.1, 1e-3) diverged at 50
                    # rounds; these are the next values in validation order
                    # (docs/results/table1-flan/diverged)
                    "method_args": {"fedprox": {"mu": 1.0}, "fedsam": {"rho": 0.5}, "feddyn": {"alpha": 0.1},
                                    "fedyogi": {"server_lr": 0.01, "tau": 1e-3}, "pflalign": {"beta": 0.8}}},
    # FLAN's validated values, not tuned again on Dolly (issue 58: no new tuning toward the paper;
    # docs/results/table1-dolly/README.md)
    "table1-dolly": {"methods": TABLE1_METHODS, "seeds": [0, 1, 2],
                     "datasets": [{"name": "dolly", "config": "dolly-paper"}]},
}
SWEEP_PRESETS["table1-dolly"]["method_args"] = SWEEP_PRESETS["table1-flan"]["method_args"]

# Choosing the baselines' key hyperparameters (and pFLAlign's β, with the same budget of 4
# values) on a validation split carved from each client's training data (data.validation:
# 50 of FLAN's 300), never the test split, at a reduced protocol: 10 rounds, one seed.
TUNE_GRID = {
    "fedprox": {"mu": [0.001, 0.01, 0.1, 1.0]},
    "fedsam": {"rho": [0.01, 0.05, 0.1, 0.5]},
    "feddyn": {"alpha": [0.001, 0.01, 0.1, 1.0]},
    "fedyogi": {"server_lr": [0.01, 0.1], "tau": [1e-3, 1e-5]},
    "fedgloss": {"rho": [0.01, 0.05, 0.15, 0.5]},
    "pflalign": {"beta": [0.8, 0.9, 0.95, 0.99]},
}
SWEEP_PRESETS["tune-flan"] = {
    "methods": ["fedavg", *TUNE_GRID], "seeds": [0], "grid": TUNE_GRID,
    "base": {"rounds": 10, "data": {"validation": 50}, "eval": {"base_model": False}},
    "datasets": [{"name": "flan", "config": "flan-paper"}],
}

SWEEP_KEYS = {"methods", "seeds", "datasets", "base", "method_args", "grid"}
DATASET_KEYS = {"name", "config", "data_dir", "set"}


@dataclass
class PlannedRun:
    """One grid point: where it goes and its full config."""

    dataset: str
    method: str  # the method's name, or a grid point's: "fedprox@mu=0.01"
    seed: int
    cfg: RunConfig
    out: Path
    done: Path | None = None  # a finished copy of this run kept elsewhere (--done)

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.method}/seed{self.seed}"

    def state(self) -> str:
        """'finished', 'unfinished' (a checkpoint to resume) or 'new'."""
        from . import checkpoint as ckpt

        if self.done is not None or (self.out / ckpt.RESULTS).exists():
            return "finished"
        if ckpt.has_run_checkpoint(self.out):
            return "unfinished"
        return "new"

    def results(self) -> dict:
        """A finished run's results (`report.read_results`); a `UserError` saying what to do
        when they cannot be used (a truncated or damaged results.json, here or under --done)."""
        from . import checkpoint as ckpt
        from .analysis.runs import read_results

        try:
            return read_results((self.done or self.out) / ckpt.RESULTS)
        except UserError as exc:
            if self.done is not None:
                raise UserError(f"{exc}: this finished run under --done cannot be used; restore it there (e.g. "
                                f"git checkout), or remove that folder and the sweep runs it into {self.out}") from None
            raise UserError(f"{exc}: this run is marked finished but its results cannot be used; rerun it with "
                            f"pflalign run --out {self.out} --overwrite (with its config)") from None


def dry_run(runs: list[PlannedRun]) -> tuple[list[str], UserError | None]:
    """`sweep --dry-run`: one line per run saying what the sweep will do with it (run it, resume
    it, skip it as finished), read as the sweep reads it: a run whose results.json cannot be
    used is listed as ``damaged``, and the error says that the sweep stops there (None: it won't);
    an unfinished run's line says the round its checkpoint is after."""
    from . import checkpoint as ckpt

    lines, stop = [], None
    for r in runs:
        state, where = r.state(), r.done or r.out
        if state == "finished":
            try:
                note = f"skipped, avg ROUGE-L {r.results()['avg_rouge_l_personalized']:.2f}"
            except UserError as exc:
                state, note, stop = "damaged", "the sweep stops here", stop or (r, exc)
        elif state == "unfinished":
            note = "resumed from its checkpoint"
            done = ckpt.rounds_checkpointed(r.out)
            note += "" if done is None else f" after round {done} of {r.cfg.rounds}"
            kept = ckpt.kept_jobs(r.out)  # its final scoring under way: the jobs it finished
            note += f", {kept} scoring job{'s' * (kept != 1)} kept" if kept else ""
        else:
            note = "runs"
        lines.append(f"{r.key:<40} {state:<10} {where}  ({note})")
    if stop is not None:
        r, exc = stop
        before = sum(1 for p in runs[:runs.index(r)] if p.state() != "finished")
        return lines, UserError(f"the sweep would run {before} runs, then stop at {r.key}: {exc}")
    return lines, None


def load_sweep_source(source: str) -> dict:
    """A sweep preset name or a TOML/JSON file → dict (not yet checked)."""
    if source in SWEEP_PRESETS and not Path(source).exists():
        return json.loads(json.dumps(SWEEP_PRESETS[source]))  # deep copy
    if not Path(source).is_file():
        raise UserError(f"sweep config {source!r} is neither a file nor a preset; presets: {', '.join(SWEEP_PRESETS)}")
    return load_config_source(source)


def _list_of(spec: dict, key: str, kind: type) -> list:
    values = spec.get(key)
    if not isinstance(values, list) or not values:
        raise UserError(f"sweep config: {key!r} must be a non-empty list")
    for v in values:
        if not isinstance(v, kind) or isinstance(v, bool):
            raise UserError(f"sweep config: {key!r} holds {v!r}, expected {kind.__name__} values")
    if len(set(map(str, values))) != len(values):
        raise UserError(f"sweep config: {key!r} lists a value twice")
    return values


def _table(spec: dict, key: str, where: str = "sweep config") -> dict:
    value = spec.get(key, {})
    if not isinstance(value, dict):
        raise UserError(f"{where}: {key!r} must be a table")
    return value


def _check_keys(table: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(allowed))}")


def plan_sweep(source: str, out: Path | str, overrides: dict | None = None,
               data_dir: str | None = None, seeds: list[int] | None = None,
               done: list[Path | str] = (), methods: list[str] | None = None) -> list[PlannedRun]:
    """Every run of the sweep, with its config built and checked, in run order
    (dataset, then method, then seed). `seeds` replaces the config's seeds; `methods`
    keeps only those of the config's methods (each run's config unchanged);
    `done` lists folders of finished runs in the sweep's layout, kept elsewhere."""
    for folder in done:
        if not Path(folder).is_dir():
            raise UserError(f"--done {folder}: not a folder")
    spec = load_sweep_source(source)
    if not isinstance(spec, dict):
        raise UserError("sweep config: expected a table with methods, seeds, datasets")
    if seeds is not None:
        spec["seeds"] = seeds
    _check_keys(spec, SWEEP_KEYS, "sweep config")
    if methods is not None:  # part of a sweep: its other methods' args and grids go with them
        listed = _list_of(spec, "methods", str)
        missing = [m for m in methods if m not in listed]
        if missing or not methods:
            raise UserError(f"--methods {','.join(missing) or '(none)'}: choose among this sweep's "
                            f"methods: {', '.join(listed)}")
        spec["methods"] = [m for m in listed if m in methods]
        for key in ("method_args", "grid"):
            if isinstance(spec.get(key), dict):
                spec[key] = {m: v for m, v in spec[key].items() if m in methods}
    methods = _list_of(spec, "methods", str)
    for m in methods:
        check_method_name(m)  # unknown name → UserError with a suggestion, before torch loads
    from . import checkpoint as ckpt
    seeds = _list_of(spec, "seeds", int)
    datasets = spec.get("datasets")
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        raise UserError("sweep config: 'datasets' must be a non-empty list of tables (name, config, data_dir, set)")
    if data_dir is not None and len(datasets) > 1:
        raise UserError("--data-dir is ambiguous with several datasets; give each its data_dir in the sweep config")
    for key in ("method", "seed"):
        if key in (overrides or {}):
            raise UserError(f"--set {key}=... does not apply to a sweep: list them in the sweep config's {key}s")
    base = _table(spec, "base")
    per_method = _table(spec, "method_args")
    for m in per_method:
        if m not in methods:
            raise UserError(f"sweep config: method_args.{m} names a method that is not in 'methods'")
    grid = _table(spec, "grid")
    points = {m: _grid_points(grid, m) for m in methods}
    for m in grid:
        if m not in methods:
            raise UserError(f"sweep config: grid.{m} names a method that is not in 'methods'")

    runs, names = [], set()
    for entry in datasets:
        _check_keys(entry, DATASET_KEYS, "sweep config dataset")
        name = entry.get("name")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise UserError(f"sweep config: every dataset needs a plain 'name' (a folder name), got {name!r}")
        if name in names:
            raise UserError(f"sweep config: dataset name {name!r} is used twice")
        names.add(name)
        where = f"sweep config dataset {name!r}"
        if not isinstance(entry.get("config", ""), str):
            raise UserError(f"{where}: 'config' must be a preset name or a file path")
        common = load_config_source(entry.get("config"))
        for layer in (base, _table(entry, "set", where), overrides or {}):
            common = merge(common, layer)
        chosen_dir = data_dir if data_dir is not None else entry.get("data_dir")
        if chosen_dir is not None:
            common = merge(common, {"data": {"dir": _absolute_if_exists(str(chosen_dir))}})
        for method, (variant, args, run_keys) in ((m, p) for m in methods for p in points[m]):
            for seed in seeds:
                layers = merge(common, {"method_args": _table(per_method, method, "sweep config method_args")})
                layers = merge(layers, _nested(run_keys))
                layers = merge(layers, {"method": method, "seed": seed, "method_args": args})
                cfg = build_config(None, layers, defaults="library")
                if cfg.data.name != "synthetic" and not cfg.data.dir:
                    raise UserError(f"dataset {name!r} ({cfg.data.name}) needs its data: pass --data-dir "
                                    f"or give data_dir in the sweep config")
                where_to = Path(out) / name / variant / f"seed{seed}"
                copies = [Path(f) / name / variant / f"seed{seed}" for f in done]
                finished = next((c for c in copies if (c / ckpt.RESULTS).is_file()), None)
                runs.append(PlannedRun(name, variant, seed, cfg, where_to, finished))
    for r in runs:
        _check_same_config(r)
    return runs


def _grid_points(grid: dict, method: str) -> list[tuple[str, dict, dict]]:
    """(folder name, method_args, run-config keys) of every combination of a method's grid
    values; the method alone when it has no grid. A grid key is one of the method's arguments,
    else a run-config key (dotted for nested ones: ``lr``, ``eval.every``), so a learning-rate
    grid is ``[grid.fedavg] lr = [...]``; method, seed and data.dir belong to the grid itself."""
    table = _table(grid, method, "sweep config grid")
    if not table:
        return [(method, {}, {})]
    from .methods import method_class

    arg_names = set(method_class(method).arg_names())
    for key, values in table.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"sweep config: grid.{method}.{key} must be a non-empty list of values")
        if key not in arg_names and (key in ("method", "seed", "method_args", "data.dir")
                                     or not _is_run_key(key)):
            raise UserError(f"sweep config: grid.{method}.{key} is neither an argument of {method} "
                            f"({', '.join(sorted(arg_names)) or 'none'}) nor a run-config key")
    points = [{}]
    for key, values in table.items():
        points = [{**p, key: v} for p in points for v in values]
    return [(method + "@" + ",".join(f"{k}={v}" for k, v in p.items()),
             {k: v for k, v in p.items() if k in arg_names},
             {k: v for k, v in p.items() if k not in arg_names}) for p in points]


def _is_run_key(dotted: str) -> bool:
    """Whether `dotted` names a field of RunConfig (``lr``, ``eval.every``)."""
    obj = RunConfig()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def _nested(dotted: dict) -> dict:
    """{"eval.every": 5, "lr": 0.1} → {"eval": {"every": 5}, "lr": 0.1}."""
    out: dict = {}
    for key, value in dotted.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _absolute_if_exists(path: str) -> str:
    """A local data path made absolute (so the saved config does not depend on
    the working directory); anything else (a hub id) unchanged."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def _check_same_config(run: PlannedRun) -> None:
    """Refuse to skip or resume a run directory that was made with other settings."""
    from . import checkpoint as ckpt

    saved_path = (run.done or run.out) / ckpt.CONFIG
    if run.state() == "new" or not saved_path.exists():
        return
    try:
        saved = flat(to_dict(build_config(None, json.loads(saved_path.read_text()))))
    except (UserError, ValueError, OSError) as exc:  # ValueError: not JSON, not UTF-8
        raise UserError(f"{saved_path}: unreadable saved config ({exc})") from exc
    wanted = flat(json.loads(json.dumps(to_dict(run.cfg))))
    if run.done is not None:  # a copy made on another machine: the same data may lie elsewhere there,
        # and it may have run on another device (a GPU's float32 differs from a CPU's in the last bits,
        # as two CPU kinds' do) with that device's decoding rows (eval.batch_size: 64 on a CPU, auto on
        # CUDA; rows change no prediction); the dtype, which changes results beyond that, is still compared
        for key in ("data.dir", "device", "eval.batch_size"):
            saved.pop(key, None), wanted.pop(key, None)
    diffs = [f"{k}: {saved.get(k)!r} there, {wanted.get(k)!r} now"
             for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
    if diffs:
        raise UserError(f"{run.done or run.out} was made with a different config ({'; '.join(diffs[:3])}); "
                        f"use another --out or remove that run")


def run_sweep(runs: list[PlannedRun], progress: bool = True, workers: int = 1, batch: str = "auto",
              checkpoint_every: float | None = None) -> list[dict]:
    """Run the planned runs one after another (`workers`, `batch`: engine.run's; "runs": those that
    share a base model together, `run_together`); returns each finished one's results. A run whose
    training reaches a non-finite value stops (engine.run keeps its last checkpoint) and the sweep
    goes on with the others: one grid point that blows up does not cost the rest of the grid. Such
    runs are named, with what happened, in one UserError at the end."""
    from .run.engine import run as run_one

    if batch == "runs":
        return run_together(runs, progress, workers, checkpoint_every)
    bar = tqdm(total=len(runs), desc="sweep", unit="run", disable=not progress)
    say = tqdm.write if progress else print
    width = len(str(len(runs)))
    all_results, stopped = [], []
    for i, r in enumerate(runs, start=1):
        head = f"[{i:>{width}}/{len(runs)}] {r.key}"
        state = r.state()
        bar.set_postfix_str(r.key)
        if state == "finished":
            results = r.results()
            say(f"{head}: finished earlier, avg ROUGE-L {results['avg_rouge_l_personalized']:.2f}")
        else:
            tic = time.perf_counter()
            resume = state == "unfinished"
            # a 'new' run may hold leftovers of a first round that never finished: start afresh
            try:
                results = run_one(None if resume else r.cfg, r.out, resume=resume, overwrite=not resume,
                                  progress=progress, workers=workers, batch=batch, checkpoint_every=checkpoint_every)
            except TrainingDiverged as exc:
                say(f"{head}: stopped after {(time.perf_counter() - tic) / 60:.1f} min: {exc}")
                stopped.append(f"{r.key} ({exc})")
                bar.update(1)
                continue
            what = "resumed and finished" if resume else "finished"
            say(f"{head}: {what} in {(time.perf_counter() - tic) / 60:.1f} min, "
                f"avg ROUGE-L {results['avg_rouge_l_personalized']:.2f}")
        all_results.append(results)
        bar.update(1)
    bar.close()
    if stopped:
        raise UserError(f"{len(all_results)} of {len(runs)} runs finished; {len(stopped)} stopped on a non-finite "
                        f"value (the same sweep command tries them again): {'; '.join(stopped)}")
    return all_results


def run_together(runs: list[PlannedRun], progress: bool = True, workers: int = 1,
                 checkpoint_every: float | None = None) -> list[dict]:
    """`run_sweep` with ``--batch runs``: the unfinished runs that share a base model (`base_key`:
    model, dtype, device, LoRA settings) train in lockstep, one group after another
    (`pflalign.run.together`); finished runs are skipped, a run that diverges stops alone, as in
    the sweep one run after another."""
    from .run.lockstep import check_batch
    from .run.together import base_key, run_together as train_together

    say = tqdm.write if progress else print
    for r in runs:
        check_batch("runs", workers, r.cfg)
    results: dict[int, dict] = {}
    stopped = []
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        if r.state() == "finished":
            results[i] = r.results()
            say(f"{r.key}: finished earlier, avg ROUGE-L {results[i]['avg_rouge_l_personalized']:.2f}")
        else:
            groups.setdefault(base_key(r.cfg), []).append(i)
    for members in groups.values():
        say(f"{len(members)} runs in lockstep on {runs[members[0]].cfg.model}: "
            + ", ".join(runs[i].key for i in members))
        tic = time.perf_counter()
        outcomes = train_together([(runs[i].cfg, runs[i].out, runs[i].state() == "unfinished") for i in members],
                                  progress, checkpoint_every)
        minutes = (time.perf_counter() - tic) / 60
        for i, outcome in zip(members, outcomes):
            if isinstance(outcome, TrainingDiverged):
                say(f"{runs[i].key}: stopped: {outcome}")
                stopped.append(f"{runs[i].key} ({outcome})")
            else:
                results[i] = outcome
                say(f"{runs[i].key}: finished ({len(members)} runs in {minutes:.1f} min), "
                    f"avg ROUGE-L {outcome['avg_rouge_l_personalized']:.2f}")
    if stopped:
        raise UserError(f"{len(results)} of {len(runs)} runs finished; {len(stopped)} stopped on a non-finite "
                        f"value (the same sweep command tries them again): {'; '.join(stopped)}")
    return [results[i] for i in sorted(results)]
