"""`pflalign` command line: run, sweep, rescore, report, methods, fetch-model; export, generate (commands.py).

Bad input (a `UserError`) ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .errors import RunInterrupted, UserError


def _print_table(results: dict) -> None:
    rows = results["clients"]
    width = max(len("client"), *(len(r["task"]) for r in rows), len("average"))
    print(f"\n{results['method']} on {results['dataset']} (seed {results['seed']}), ROUGE-L x100")
    print(f"{'client':<{width}}  {'n_test':>6}  {'personalized':>12}  {'global':>8}  {'base':>8}")

    def fmt(x, w):
        return f"{x:>{w}.2f}" if x is not None else f"{'-':>{w}}"

    for r in rows:
        print(f"{r['task']:<{width}}  {r['n_test']:>6}  {fmt(r['rouge_l_personalized'], 12)}  "
              f"{fmt(r['rouge_l_global'], 8)}  {fmt(r['rouge_l_base'], 8)}")
    print(f"{'average':<{width}}  {'':>6}  {fmt(results['avg_rouge_l_personalized'], 12)}  "
          f"{fmt(results['avg_rouge_l_global'], 8)}  {fmt(results['avg_rouge_l_base'], 8)}")


def quiet_library_bars() -> None:
    """--no-progress: transformers' own bars off too (weight loading; model/model_cache.py follows the same
    switch for the GGUF de-quantization bar, a plain tqdm that transformers' switch does not reach)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _check_checkpoint_every(args) -> None:
    if args.checkpoint_every is not None and not args.checkpoint_every >= 0:
        raise UserError(f"--checkpoint-every must be >= 0 seconds, got {args.checkpoint_every:g}")


def cmd_run(args) -> int:
    from .config import build_config, parse_set

    overrides = parse_set(args.set or [])
    if args.data_dir is not None:
        overrides.setdefault("data", {})["dir"] = args.data_dir
    if args.method is not None:
        overrides["method"] = args.method
    if args.stop_after_rounds is not None and args.stop_after_rounds < 1:
        raise UserError(f"--stop-after-rounds must be >= 1, got {args.stop_after_rounds}")
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    _check_checkpoint_every(args)
    if args.resume and (args.set or args.data_dir or args.method):
        raise UserError("--resume continues with the run's saved config; drop --set/--data-dir/--method")
    if args.allow_recipe_change and not args.resume:
        raise UserError("--allow-recipe-change goes with --resume (a run's config.json edited since its checkpoint)")
    cfg = None if args.resume else build_config(args.config, overrides, defaults="library")
    # the engine (torch, transformers: seconds, more under load) only once the config is checked
    from .run.engine import run

    if args.no_progress:
        quiet_library_bars()
    results = run(cfg, Path(args.out), resume=args.resume, overwrite=args.overwrite,
                  stop_after=args.stop_after_rounds, progress=not args.no_progress, workers=args.workers,
                  allow_recipe_change=args.allow_recipe_change, batch=args.batch,
                  checkpoint_every=args.checkpoint_every)
    if results is None:
        print(f"stopped after the requested rounds; continue with: pflalign run --out {args.out} --resume")
        return 0
    _print_table(results)
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return 0


def cmd_sweep(args) -> int:
    from .config import parse_set
    from .sweep import dry_run, plan_sweep, run_sweep

    seeds = None
    if args.seeds is not None:
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--seeds expects comma-separated integers, got {args.seeds!r}") from None
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    _check_checkpoint_every(args)
    runs = plan_sweep(args.config, Path(args.out), parse_set(args.set or []), args.data_dir, seeds,
                      done=args.done or [], methods=methods)
    if args.dry_run:  # what the sweep will do with each run, read as it reads them
        lines, stop = dry_run(runs)
        print("\n".join(lines))
        if stop is not None:
            raise stop
        return 0
    from .run.run_dir import RunLock

    if args.no_progress:
        quiet_library_bars()

    try:
        with RunLock(Path(args.out), "sweep"):  # one sweep at a time in a folder (each run also locks its own)
            run_sweep(runs, progress=not args.no_progress, workers=args.workers, batch=args.batch,
                      checkpoint_every=args.checkpoint_every)
    except KeyboardInterrupt:
        print("pflalign: interrupted; rerun the same sweep command to continue where it stopped", file=sys.stderr)
        return 130
    print(f"\n{len(runs)} runs finished under {args.out}; tables and figures: pflalign report {args.out} --out REPORT_DIR")
    return 0


def cmd_rescore(args) -> int:
    from .config import parse_set
    from .run.rescore import rescore

    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.no_progress:
        quiet_library_bars()
    results = rescore(Path(args.run_dir), Path(args.out), parse_set(args.set or []), overwrite=args.overwrite,
                      progress=not args.no_progress, workers=args.workers)
    _print_table(results)
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return 0


def cmd_report(args) -> int:
    from .analysis.report_md import write_report

    paired = tuple(args.paired) if args.paired else None
    print(write_report([Path(d) for d in args.dir], Path(args.out), client=args.client, metric=args.metric, paired_against=paired,
                       claims=args.claims))
    return 0


def cmd_methods(args) -> int:
    from .methods import METHODS

    for name, cls in METHODS.items():
        if args.long:
            doc = cls.__doc__ or sys.modules[cls.__module__].__doc__ or ""
            doc = " ".join(doc.strip().split("\n\n")[0].split())
            print(f"{name:<28} {doc}")
        else:
            print(name)
    return 0


def cmd_fetch_model(args) -> int:
    from .model import fetch_embedded_model, load_base_model

    path = fetch_embedded_model(args.name)
    # de-quantized once now (float32, the default dtype), so that no run or ClientApp on this host waits for it
    load_base_model(args.name)
    print(path)
    return 0


WORKERS_HELP = ("train a round's clients, and score them, in N processes of one thread each (CPU; default 1: "
                "this process with all its threads); N = the cores is fastest, and the results equal a "
                "one-thread run's bit for bit")
BATCH_CHOICES = ("auto", "none", "clients")
BATCH_HELP = ("clients: train a round's clients in lockstep, local step t of all of them in one forward and "
              "backward through the base, each with its own adapter, and score every client's personalized and "
              "global models in one decoding loop (results equal the one-at-a-time run's to float rounding; not "
              "with --workers > 1 or gradient accumulation); none: one at a time; default auto: on CUDA the "
              "clients train in lockstep (measured faster there) and are scored one model at a time; none "
              "elsewhere")
CHECKPOINT_EVERY_HELP = ("save the run's checkpoint (and the clients' records, held in memory between) when "
                         "SECONDS have passed since the last one, and after the last round; 0: after every round. "
                         "Default: every round on the CPU, every 60 s on CUDA, where a round trains in a second or two and "
                         "writing the clients' files every round takes about as long. A crash or "
                         "Ctrl-C loses at most the rounds since; results are the same either way")
SWEEP_BATCH_HELP = BATCH_HELP.replace("; default auto", "; runs: the runs that share a base model together, "
                                      "every client of every run in lockstep; default auto")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pflalign", description="Personalized federated LoRA fine-tuning (pFLAlign and baselines).")
    parser.add_argument("-v", "--verbose", action="store_true", help="more log output")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one federated job")
    run.add_argument("--config", help="a preset (demo, flan-paper, dolly-paper) or a TOML/JSON file")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable), e.g. method=fedavg lora.r=8")
    run.add_argument("--data-dir", help="dataset location (same as --set data.dir=...)")
    run.add_argument("--method", help="the method (same as --set method=...); `pflalign methods` lists them")
    run.add_argument("--out", required=True, help="run directory")
    run.add_argument("--resume", action="store_true", help="continue an unfinished run in --out")
    run.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    run.add_argument("--allow-recipe-change", action="store_true",
                     help="with --resume: train the rounds left with the training settings config.json now has, "
                          "though its checkpoint's rounds had others (refused without it; metrics.jsonl records it)")
    run.add_argument("--stop-after-rounds", type=int, metavar="N", help="stop (checkpointed) after N more rounds")
    run.add_argument("--no-progress", action="store_true", help="no progress bars (log lines instead)")
    run.add_argument("--workers", type=int, default=1, metavar="N", help=WORKERS_HELP)
    run.add_argument("--batch", choices=BATCH_CHOICES, default="auto", help=BATCH_HELP)
    run.add_argument("--checkpoint-every", type=float, metavar="SECONDS", help=CHECKPOINT_EVERY_HELP)
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", help="run a grid of datasets x methods x seeds, skipping finished runs")
    sweep.add_argument("--config", required=True, help="a sweep preset (table1-flan, table1-dolly) or a TOML/JSON sweep file")
    sweep.add_argument("--out", required=True, help="sweep directory: runs go to OUT/<dataset>/<method>/seed<k>/")
    sweep.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a run-config key in every run (repeatable)")
    sweep.add_argument("--data-dir", help="the dataset location (a sweep with one dataset)")
    sweep.add_argument("--seeds", metavar="S,S,...", help="replace the sweep's seeds, e.g. 0,1")
    sweep.add_argument("--methods", metavar="M,M,...",
                       help="run only these of the sweep's methods (their runs' configs unchanged), e.g. local,pflalign")
    sweep.add_argument("--dry-run", action="store_true", help="list the runs, their state and what the sweep will do with each; run nothing")
    sweep.add_argument("--done", action="append", metavar="DIR",
                       help="a folder of finished runs in the sweep's layout kept elsewhere (e.g. committed "
                            "results): a run found there with the same config is skipped (repeatable)")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bars")
    sweep.add_argument("--workers", type=int, default=1, metavar="N", help=WORKERS_HELP)
    sweep.add_argument("--batch", choices=BATCH_CHOICES + ("runs",), default="auto", help=SWEEP_BATCH_HELP)
    sweep.add_argument("--checkpoint-every", type=float, metavar="SECONDS", help=CHECKPOINT_EVERY_HELP)
    sweep.set_defaults(func=cmd_sweep)

    rescore = sub.add_parser("rescore", help="score a finished run's models again under other evaluation settings")
    rescore.add_argument("run_dir", help="a finished run folder that still holds its checkpoint")
    rescore.add_argument("--out", required=True, help="the new run folder (config, metrics, scores, adapters)")
    rescore.add_argument("--set", action="append", metavar="KEY=VALUE", required=True,
                         help="an evaluation setting: eval.* or the method's evaluation argument, e.g. "
                              "method_args.personalized=after_aggregation (pFLAlign, FedSA-LoRA)")
    rescore.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    rescore.add_argument("--no-progress", action="store_true", help="no progress bars")
    rescore.add_argument("--workers", type=int, default=1, metavar="N", help=WORKERS_HELP)
    rescore.set_defaults(func=cmd_rescore)

    report = sub.add_parser("report", help="tables and figures from finished runs")
    report.add_argument("dir", nargs="+", help="folder holding finished runs (e.g. a sweep's --out); several: "
                        "their runs in one report (a method's seed in two of them is refused)")
    report.add_argument("--out", required=True, help="folder for report.md, tables and figures")
    report.add_argument("--client", metavar="TASK", help="client of the GSNR and loss figures (default: structure_to_text, else the first)")
    report.add_argument("--metric", choices=("rouge_l", "exact_match"), default="rouge_l",
                        help="the tables' score (default rouge_l; exact_match: normalised, for short-label tasks)")
    report.add_argument("--paired", action="append", metavar="METHOD",
                        help="a table of METHOD minus each other method, seed by seed (repeatable; default pflalign)")
    report.add_argument("--claims", action="store_true",
                        help="judge the paper's five FLAN Table 1 claims by the rules in docs/results/table1-flan "
                             "(pflalign.analysis.claims)")
    report.set_defaults(func=cmd_report)

    methods = sub.add_parser("methods", help="list the available methods")
    methods.add_argument("-l", "--long", action="store_true", help="with one line of description")
    methods.set_defaults(func=cmd_methods)

    fetch = sub.add_parser("fetch-model", help="download an embedded model into the cache and de-quantize it there once")
    fetch.add_argument("name", nargs="?", default="smollm2-135m")
    fetch.set_defaults(func=cmd_fetch_model)

    from .commands import register

    register(sub)  # export, generate (commands.py)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    for noisy in ("transformers", "peft", "httpx", "huggingface_hub", "absl"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if argv is None and args.command in ("run", "sweep"):  # the console command, about to train
            from .run.allocator import reexec_under_mimalloc

            reexec_under_mimalloc()  # returns in the re-executed process (run/allocator.py says why)
        return args.func(args)
    except UserError as exc:
        print(f"pflalign: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a run says where it stopped and how to resume
        print(f"pflalign: {exc}" if isinstance(exc, RunInterrupted) else "pflalign: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `pflalign methods -l | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush must not fail again
        return 141


if __name__ == "__main__":
    sys.exit(main())
