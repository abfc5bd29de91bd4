"""`pflalign export` and `pflalign generate`: a run's models outside training.

Registered on the main parser by `cli.build_parser` (`register`). Bad input is a
`UserError`: one line on stderr, exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import UserError


# ---- pflalign export ------------------------------------------------------------
def cmd_export(args) -> int:
    from .run.export import export_run

    written = export_run(Path(args.run_dir), Path(args.out), client=args.client, merged=args.merged,
                         only_global=args.use_global, base_copy=args.base_copy and Path(args.base_copy))
    if args.base_copy:
        print(f"base model: {Path(args.base_copy).expanduser()}")
    kind = "merged model" if args.merged else "adapter"
    for name, folder in written.items():
        print(f"{kind} {name}: {folder}")
    return 0


# ---- pflalign generate -------------------------------------------------------------
def adapter_folders(root: Path) -> dict[str, Path]:
    """{"global" | client name: adapter folder} of the adapter folders in `root` (a run's
    ``adapters/`` or a `pflalign export` folder)."""
    from .run.adapter_folder import ADAPTER_CONFIG, GLOBAL, INFO

    folders = {}
    for sub in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        if not (sub / ADAPTER_CONFIG).exists():
            continue
        try:
            client = json.loads((sub / INFO).read_text()).get("client")
        except (OSError, ValueError):
            client = None
        folders[GLOBAL if sub.name == GLOBAL else client or sub.name] = sub
    return folders


def run_adapter_folders(run_dir: Path) -> dict[str, Path]:
    """{"global" | client name: adapter folder} of a finished run's ``adapters/``."""
    from .run.export import ADAPTERS

    return adapter_folders(Path(run_dir) / ADAPTERS)


def exported_adapters(path: Path):
    """(run config, {"global" | client: folder}) of an exported folder: `pflalign export`'s --out
    (or a run's ``adapters/``), or one adapter folder; the config is the one each adapter's
    pflalign.json records. None when `path` holds no adapter folder."""
    from .config import build_config
    from .run.adapter_folder import ADAPTER_CONFIG, GLOBAL, INFO

    path = Path(path)
    if (path / ADAPTER_CONFIG).exists():  # one adapter folder
        try:
            client = json.loads((path / INFO).read_text()).get("client")
        except (OSError, ValueError):
            client = None
        folders = {GLOBAL if client is None else client: path}
    else:
        folders = adapter_folders(path)
    if not folders:
        return None
    try:
        saved = json.loads((next(iter(folders.values())) / INFO).read_text())["config"]
    except (OSError, ValueError, KeyError):
        raise UserError(f"{path}: its adapters do not record their run's config (pflalign.json); generate "
                        "from the run folder, or export it again") from None
    return build_config(None, saved), folders


def load_generator(run_dir: Path, client: str | None):
    """(model with the adapter merged in, tokenizer, run config) for `client` (None: global) of a
    finished run, an exported folder or one adapter folder (`exported_adapters`)."""
    import torch

    from . import checkpoint as ckpt
    from .config import build_config
    from .run.adapter_folder import GLOBAL, merge_adapter
    from .model import load_base_model

    run_dir = Path(run_dir)
    exported = None if (run_dir / ckpt.CONFIG).exists() else exported_adapters(run_dir)
    if exported is not None:
        cfg, folders = exported
    elif not (run_dir / ckpt.CONFIG).exists():
        raise UserError(f"{run_dir} holds no run (no {ckpt.CONFIG}) and no exported adapters")
    elif not (run_dir / ckpt.RESULTS).exists():  # adapters/ of an earlier run may still be there: not these
        raise UserError(f"{run_dir} holds no finished run (no {ckpt.RESULTS}); write the adapters of its "
                        f"checkpoint with: pflalign export {run_dir} --out DIR")
    else:
        folders = run_adapter_folders(run_dir)
        if not folders:
            raise UserError(f"{run_dir} has no adapters (a run writes adapters/ when it finishes); "
                            f"write them with: pflalign export {run_dir} --out {run_dir / 'adapters'}")
        cfg = build_config(None, json.loads((run_dir / ckpt.CONFIG).read_text()))
    name = GLOBAL if client is None else client
    if name not in folders:
        known = ", ".join(n for n in folders if n != GLOBAL) or "none"
        raise UserError(f"no {'global model' if name == GLOBAL else f'client {client!r}'} in {run_dir}; "
                        f"clients: {known}" + (" (or --global)" if GLOBAL in folders else ""))
    base, tokenizer = load_base_model(cfg.model, getattr(torch, cfg.dtype))
    return merge_adapter(base, folders[name]).eval(), tokenizer, cfg


def generate_stream(model, tokenizer, cfg, prompt: str, max_new_tokens: int, out=None,
                    temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None) -> str:
    """Generate one answer to `prompt` in the training prompt format, its text streamed to
    `out` as it is produced (None: not streamed); greedy unless `temperature` > 0."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    from .data import Example
    from .evaluate import _eos_ids
    from .prompts import encode_prompt

    ids, _ = encode_prompt(tokenizer, Example(prompt, ""), cfg.max_seq_len, cfg.data.template)

    class Stream(BaseStreamer):  # decodes the new tokens so far and writes what was not yet written
        def __init__(self):
            self.tokens, self.shown, self.first = [], "", True

        def put(self, value):
            if self.first:  # the prompt
                self.first = False
                return
            self.tokens += value.reshape(-1).tolist()
            text = tokenizer.decode(self.tokens, skip_special_tokens=True)
            if out is not None and not text.endswith("\ufffd"):  # a byte-level character half done
                out.write(text[len(self.shown):])
                out.flush()
                self.shown = text

        def end(self):
            pass

    stream = Stream()
    sampling = temperature > 0
    options = dict(do_sample=sampling, max_new_tokens=max_new_tokens, eos_token_id=_eos_ids(model, tokenizer),
                   pad_token_id=tokenizer.pad_token_id, streamer=stream)
    if sampling:
        options.update(temperature=temperature, top_p=top_p or 1.0, top_k=top_k or 0)
    else:
        options.update(temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       **options)
    text = tokenizer.decode(stream.tokens, skip_special_tokens=True)
    if out is not None:
        out.write(text[len(stream.shown):] + "\n")
        out.flush()
    return text.strip()


def cmd_generate(args) -> int:
    import torch

    if args.client is None and not args.use_global:
        one = exported_adapters(Path(args.run_dir)) if (Path(args.run_dir) / "adapter_config.json").exists() else None
        if one is None:
            raise UserError("name a client with --client NAME, or --global for the global model")
        args.client = next(iter(one[1]))  # one adapter folder: its own model
        args.client = None if args.client == "global" else args.client
    if args.client is not None and args.use_global:
        raise UserError("--client and --global exclude each other")
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    model, tokenizer, cfg = load_generator(Path(args.run_dir), args.client)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    prompts = [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in sys.stdin)
    for prompt in prompts:
        if prompt.strip():
            generate_stream(model, tokenizer, cfg, prompt, args.max_new_tokens, sys.stdout,
                            args.temperature, args.top_p, args.top_k)
    return 0


def register(sub) -> None:
    """Add `export` and `generate` to the main parser's subcommands."""
    export = sub.add_parser("export", help="a run's adapters (PEFT folders) or merged models, for other tools")
    export.add_argument("run_dir", help="a finished or checkpointed run directory")
    export.add_argument("--out", required=True, help="folder for global/ and one folder per client")
    export.add_argument("--client", metavar="NAME", help="only this client's personalized model")
    export.add_argument("--global", dest="use_global", action="store_true", help="only the global model")
    export.add_argument("--merged", action="store_true",
                        help="full Hugging Face model folders with LoRA folded in (AutoModelForCausalLM alone loads them)")
    export.add_argument("--base-copy", metavar="DIR",
                        help="also write the base model as a safetensors model folder into DIR (once: kept if there); "
                             "the adapters name it as their base")
    export.set_defaults(func=cmd_export)

    gen = sub.add_parser("generate", help="generate with a finished run's personalized or global model")
    gen.add_argument("run_dir", help="a finished run directory (with adapters/), a `pflalign export` folder, "
                                     "or one adapter folder")
    gen.add_argument("prompt", nargs="?", help="the prompt; without it, prompts are read from stdin, one per line")
    gen.add_argument("--client", metavar="NAME", help="the client whose personalized model answers")
    gen.add_argument("--global", dest="use_global", action="store_true", help="the global model answers")
    gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default 128")
    gen.add_argument("--temperature", type=float, default=0.0, help="> 0: sample (default 0: greedy)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling (with --temperature)")
    gen.add_argument("--top-k", type=int, help="top-k sampling (with --temperature)")
    gen.add_argument("--seed", type=int, help="seed of the sampling")
    gen.set_defaults(func=cmd_generate)
    _prompt_after_options(gen)


def _prompt_after_options(parser) -> None:
    """Let the optional PROMPT follow the options (``generate RUN --client X "PROMPT"``): argparse
    fills an optional positional in the first run of positionals and leaves a later one over."""
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extra = parse(args, namespace)
        if getattr(ns, "prompt", None) is None and len(extra) == 1 and not extra[0].startswith("-"):
            ns.prompt, extra = extra[0], []
        return ns, extra

    parser.parse_known_args = parse_known_args
