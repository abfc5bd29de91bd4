"""What crosses the wire between the ServerApp and the ClientApps, and the
configuration of a Flower run.

Only LoRA tensors travel. Each `Params` group is one ArrayRecord whose array
names are the adapter's parameter names (PEFT's, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``);
the records are named ``global`` (w^r), ``broadcast/<group>`` (what
``method.broadcast`` adds, e.g. SCAFFOLD's ``broadcast/c``) and
``message/<group>`` (what ``method.client_end`` returns, e.g.
``message/params``, ``message/delta_c``). bfloat16 has no NumPy dtype: such
tensors travel as float32 (exact) and are cast back on arrival. A client's
method state never travels unless the method puts it in its message.

Run configuration (``[tool.flwr.app.config]`` in pyproject.toml, overridden
with ``flwr run --run-config``): ``config`` and ``set`` are ``pflalign run
--config`` and ``--set``; the ServerApp resolves them once and sends the
resolved configuration (JSON) with every message, so every node runs the
same one. The other keys are about the Flower run itself (`RUN_DEFAULTS`).
"""

from __future__ import annotations

import json
import shlex

import torch
from flwr.app import ArrayRecord, RecordDict

from ..config import RunConfig, build_config, parse_set, to_dict
from ..errors import UserError
from ..methods.base import Params
from .privacy import OPTIONS as PRIVACY_OPTIONS

GLOBAL = "global"
BROADCAST = "broadcast/"
MESSAGE = "message/"

# The keys of [tool.flwr.app.config] and their defaults (pyproject.toml holds the same).
RUN_DEFAULTS = {
    "config": "",  # a preset or a TOML/JSON file on the ServerApp's host (pflalign run --config)
    "set": "",  # --set overrides, space-separated: "method=scaffold rounds=2 lora.r=8" (or a JSON object)
    "out": "runs/flower",  # run directory on the ServerApp's host
    "overwrite": False,  # replace a run already in `out`
    "resume": False,  # continue the unfinished run in `out` (its saved config; `config`/`set` ignored)
    "min-clients": 0,  # replies that let a round finish; 0: every client sampled for the round
    "round-timeout": 3600,  # seconds to wait for a round's replies
    "connect-timeout": 600,  # seconds to wait at the start for one SuperNode per client
    "client-dir": "",  # where clients keep their state when the node config has no state-dir
    "max-update-norm": 0.0,  # reject a client update whose norm exceeds this (see validate.py); 0: no bound
    "max-update-ratio": 10.0,  # reject an update larger than this x the global model's norm (validate.py); 0: off
    **PRIVACY_OPTIONS,  # differential privacy and SecAgg+ (privacy.py)
}


# ---- tensors ------------------------------------------------------------------
def to_record(params: Params) -> ArrayRecord:
    if not params:
        return ArrayRecord()
    return ArrayRecord({n: (t.float() if t.dtype == torch.bfloat16 else t).detach().cpu() for n, t in params.items()})


def from_record(record: ArrayRecord, dtype: torch.dtype | None, device="cpu") -> Params:
    """The tensors of `record` (cast to `dtype`; None: as they arrived)."""
    return {n: t.to(device=device, dtype=dtype) for n, t in record.to_torch_state_dict().items()}


def pack(prefix: str, groups: dict[str, Params]) -> dict[str, ArrayRecord]:
    """{"c": params} → {"broadcast/c": ArrayRecord} (a `Message` or a broadcast)."""
    return {prefix + name: to_record(params) for name, params in groups.items()}


def unpack(content: RecordDict, prefix: str, dtype: torch.dtype | None, device="cpu") -> dict[str, Params]:
    return {key[len(prefix):]: from_record(rec, dtype, device)
            for key, rec in content.array_records.items() if key.startswith(prefix)}


def payload_bytes(content: RecordDict) -> int:
    """The tensor bytes of a message (array data and names; Flower's framing not counted)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())


# ---- configuration --------------------------------------------------------------
def parse_overrides(text: str) -> dict:
    """The `set` run-config string: --set items separated by spaces (shell quoting
    for values with spaces), or one JSON object with the config's nesting."""
    text = (text or "").strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"run config `set`: not valid JSON: {exc}") from exc
    return parse_set(shlex.split(text))


def resolve_config(run_config: dict) -> RunConfig:
    """The RunConfig of a fresh Flower run from its run config."""
    return build_config(run_config.get("config") or None, parse_overrides(run_config.get("set", "")))


def config_json(cfg: RunConfig) -> str:
    return json.dumps(to_dict(cfg))


def config_from_json(text: str) -> RunConfig:
    return build_config(None, json.loads(text))


def client_names(cfg: RunConfig) -> list[str]:
    """The name of every client (partition-id k is the k-th); the Flower app runs today's
    federations only (one client per category), each ClientApp loading its own category."""
    from ..partition import client_names as names, uses_partitioner

    if uses_partitioner(cfg):
        raise UserError("the Flower app runs one client per category of synthetic, dolly or flan only; "
                        "run data.name=files and data.partition/test_set options with `pflalign run`")
    return names(cfg)
