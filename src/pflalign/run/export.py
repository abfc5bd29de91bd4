"""A run's models written out: PEFT adapter folders and merged models.

Every finished run writes ``adapters/global/`` and ``adapters/<client>/`` into its
folder (`write_run_adapters`); ``pflalign export`` writes the same, or full merged
Hugging Face model folders, from any finished or checkpointed run (`export_run`).

A client's adapter is its personalized model exactly as the run evaluated it:
``method.personalized_after_aggregation(global, personalized, state)`` with the
newest global adapter (FedSA-LoRA: the aggregated A with the client's own B), or
the global adapter for a client that never trained.

Each folder is written beside its place and renamed into it (`_replace_folder`): an interruption
leaves the old folder or the new one. One adapter folder, its files and the base it names, is
`run/adapter_folder.py`; its README.md (a model card), `run/model_card.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import UserError
from .adapter_folder import (CARD, GLOBAL, INFO, base_model, readable, write_adapter, write_base_copy,
                             write_merged)
from .model_card import model_card

ADAPTERS = "adapters"


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
