"""What crosses the wire between the ServerApp and the ClientApps, and the
configuration of a Flower run.

Only LoRA tensors travel. Each `Params` group is one ArrayRecord holding ONE
flat array: its tensors, flattened and concatenated in order, as float32. The
array's name in the record is its layout, a JSON list of ``[name, shape,
dtype]`` per tensor (the adapter's parameter names, PEFT's, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``),
which is all that is needed to cut it back into the same tensors (`LayoutError`
when it does not fit). One array rather than one per tensor (420 for
SmolLM2's LoRA) because Flower 1.41 sends every Array (and every 5 MB chunk
of one) as its own object, one request each on every hop (ServerApp →
SuperLink → SuperNode → ClientApp, two at a time), and a ClientApp that
asks its SuperNode for an object still in transit retries it after 1, 2, 4,
8, 10 s (``flwr.supercore.constant.PULL_INITIAL_BACKOFF``,
``PULL_BACKOFF_CAP``): with 433 objects per message the ServerApp's push of
round 1 alone took 64 s on the Deployment Engine (benchmarks/README.md).
The flat array stays meaningful for Flower's mods that work on a message's
arrays: its L2 norm is the norm over all tensors (``fixedclipping_mod``),
it is summed element-wise (``secaggplus_mod``), and a reply's params carry
the same name (layout) as the ``global`` record they answer, as
``fixedclipping_mod`` requires.

The records are named ``global`` (w^r), ``broadcast/<group>`` (what
``method.broadcast`` adds, e.g. SCAFFOLD's ``broadcast/c``) and
``message/<group>`` (what ``method.client_end`` returns, e.g.
``message/params``, ``message/delta_c``). bfloat16 has no NumPy dtype: such
tensors travel as float32 (exact) and are cast back on arrival; so do
float16 ones (exact), but they are decoded as float16. float32 is the only
wire dtype of the flat array, so a tensor that float32 cannot hold exactly
(float64, integers) is refused at sending. A client's method state never
travels unless the method puts it in its message.

Run configuration (``[tool.flwr.app.config]`` in pyproject.toml, overridden
with ``flwr run --run-config``): ``config`` and ``set`` are ``pflalign run
--config`` and ``--set``; the ServerApp resolves them once and sends the
resolved configuration (JSON, about 1 kB) with every message, so every node
runs the same one. It holds the partition's settings, never a list of the
clients or anything else that grows with their number (unless your config
names the clients in ``data.clients`` itself): client k computes its own
share from them. The other keys are about the Flower run itself (`RUN_DEFAULTS`).
"""

from __future__ import annotations

import json
import math
import shlex

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from ..config import RunConfig, build_config, parse_set, to_dict
from ..errors import UserError
from ..methods.base import Params

GLOBAL = "global"
BROADCAST = "broadcast/"
MESSAGE = "message/"
METHOD_METRIC = "method/"  # a train reply's metrics key for each of Method.round_metrics' numbers

# The keys of [tool.flwr.app.config] and their defaults (pyproject.toml holds the same).
RUN_DEFAULTS = {
    "config": "",  # a preset or a TOML/JSON file on the ServerApp's host (pflalign run --config)
    "set": "",  # --set overrides, space-separated: "method=scaffold rounds=2 lora.r=8" (or a JSON object)
    "out": "runs/flower",  # run directory on the ServerApp's host
    "overwrite": False,  # replace a run already in `out`
    "resume": False,  # continue the unfinished run in `out` (its saved config; `config`/`set` ignored)
    "allow-recipe-change": False,  # resume though config.json's training settings differ from the checkpoint's
    "min-clients": 0,  # replies that let a round finish; 0: every client sampled for the round
    "round-timeout": 3600,  # seconds to wait for a round's replies
    "connect-timeout": 600,  # seconds from the start to wait for the SuperNode of a sampled client not yet seen
    "client-dir": "",  # where clients keep their state when the node config has no state-dir
    "max-update-norm": 0.0,  # reject a client update whose norm exceeds this (see validate.py); 0: no bound
    "max-update-ratio": 10.0,  # reject an update larger than this x the global model's norm (validate.py); 0: off
    "max-size-ratio": 10.0,  # reject a reply declaring more examples than this x the round's median (validate.py); 0: off
    # differential privacy and SecAgg+ (privacy.py, docs/distributed.md)
    "dp-noise-multiplier": 0.0,  # σ: the noise's std is σ x clipping norm x the largest data weight
    "dp-clipping-norm": 0.0,  # C > 0 turns DP on: each upload's change is clipped to norm C on its client
    "dp-delta": 1e-5,  # the δ of the (ε, δ) reported in results.json
    "secagg": False,  # Flower's SecAgg+: the server sees only the sum of the uploads
    "secagg-num-shares": 1.0,  # SecAggPlusWorkflow's num_shares (a float: that fraction of the round's clients)
    "secagg-reconstruction-threshold": 0.67,  # and reconstruction_threshold (a float: fraction of the shares)
    "secagg-clipping-range": 8.0,  # every weighted upload value is clipped to [-this, this] before quantization
    "secagg-quantization-range": 4194304,  # 2**22 levels over that range
    "secagg-max-weight": 1000.0,  # >= every client's |D_k|; the quantization error grows with max-weight / |D_k|
}


# ---- tensors ------------------------------------------------------------------
FLAT_DTYPE = torch.float32  # the flat array's dtype: every tensor below travels in it exactly
# dtype on the wire (the layout's name for it) → torch dtype; bfloat16 travels as float32
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class LayoutError(ValueError):
    """A record that is not one flat array with a layout that fits it (e.g. a client's malformed reply)."""


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` is decoded as: bfloat16 travels as float32 (exact, no NumPy
    bfloat16), float16 and float32 as they are; anything else cannot travel (`to_record` refuses it)."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def to_record(params: Params) -> ArrayRecord:
    """`params` as one flat float32 array named by its layout (see the module docstring)."""
    if not params:
        return ArrayRecord()
    layout, flat = [], []
    for name, t in params.items():
        dtype = wire_dtype(t.dtype)
        if dtype not in WIRE_DTYPES.values():
            raise TypeError(f"{name}: a {t.dtype} tensor cannot travel in a float32 array exactly")
        layout.append([name, list(t.shape), str(dtype).removeprefix("torch.")])
        flat.append(t.detach().to("cpu", FLAT_DTYPE).reshape(-1))
    key = json.dumps(layout, separators=(",", ":"))
    return ArrayRecord({key: Array(torch.cat(flat).numpy())})


def read_layout(record: ArrayRecord) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The (name, shape, dtype) of each tensor in `record`, checked against its flat array
    (the record may come from an untrusted client: `LayoutError` says what is wrong)."""
    if len(record) != 1:
        raise LayoutError(f"expected one flat array, got {len(record)} arrays")
    key, array = next(iter(record.items()))
    try:
        items = json.loads(key)
        layout = [(name, tuple(shape), WIRE_DTYPES[dtype]) for name, shape, dtype in items]
    except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise LayoutError(f"the array's name is not a layout ({type(exc).__name__}: {exc})") from None
    names = [name for name, _, _ in layout]
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise LayoutError("the layout's tensor names are not distinct strings")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for _, shape, _ in layout for d in shape):
        raise LayoutError("the layout has a shape that is not a list of non-negative integers")
    size = sum(math.prod(shape) for _, shape, _ in layout)
    if array.dtype != str(FLAT_DTYPE).removeprefix("torch.") or list(array.shape) != [size]:
        raise LayoutError(f"the flat array is {array.dtype} {tuple(array.shape)}, its layout needs float32 ({size},)")
    return layout


def from_record(record: ArrayRecord, dtype: torch.dtype | None, device="cpu") -> Params:
    """The tensors of `record` (cast to `dtype`; None: in their wire dtype, `wire_dtype`),
    bit-identical to those sent, each in its own storage (not views of the flat array)."""
    if not record:
        return {}
    layout = read_layout(record)
    data = next(iter(record.values())).numpy()  # the bytes themselves, whatever the metadata said
    size = sum(math.prod(shape) for _, shape, _ in layout)
    if data.dtype != np.float32 or data.shape != (size,):
        raise LayoutError(f"the flat array holds {data.dtype} {data.shape}, its layout needs float32 ({size},)")
    flat = torch.from_numpy(data)
    tensors, start = {}, 0
    for name, shape, wire in layout:
        n = math.prod(shape)
        t = flat[start:start + n].reshape(shape).to(wire)
        tensors[name] = t.to(device=device, dtype=dtype or wire, copy=True)
        start += n
    return tensors


def pack(prefix: str, groups: dict[str, Params]) -> dict[str, ArrayRecord]:
    """{"c": params} → {"broadcast/c": ArrayRecord} (a `Message` or a broadcast)."""
    return {prefix + name: to_record(params) for name, params in groups.items()}


def unpack(content: RecordDict, prefix: str, dtype: torch.dtype | None, device="cpu") -> dict[str, Params]:
    return {key[len(prefix):]: from_record(rec, dtype, device)
            for key, rec in content.array_records.items() if key.startswith(prefix)}


def payload_bytes(content: RecordDict) -> int:
    """The tensor bytes of a message (array data and their layouts; Flower's framing not counted)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())


# ---- configuration --------------------------------------------------------------
def method_metrics(metrics) -> dict[str, float]:
    """The numbers of `Method.round_metrics` in a (validated) train reply's metrics, by name."""
    return {k[len(METHOD_METRIC):]: float(v) for k, v in metrics.items() if k.startswith(METHOD_METRIC)}


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


def run_options(run_config: dict) -> dict:
    """The run config's keys about the Flower run itself (`RUN_DEFAULTS`, the privacy ones aside:
    `privacy.from_run_config`), each checked before anything is written or loaded: a bad value
    is a `UserError` naming its key (never a `ValueError` from deep inside a round). Returns
    `RUN_DEFAULTS` updated by `run_config`, with these values as their types."""
    rc = {**RUN_DEFAULTS, **run_config}

    def number(key: str, low: float, strict: bool = False, integer: bool = False, off: bool = False):
        value = rc[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (not integer or float(value).is_integer())
        if ok and not (off and value == 0):
            ok = value > low if strict else value >= low
        if not ok:
            kind = "an integer" if integer else "a number"
            bound = f"{'>' if strict else '>='} {low:g}" + (" (or 0: off)" if off else "")
            raise UserError(f"run config {key} must be {kind} {bound}, got {value!r}")
        return int(value) if integer else float(value)

    for key in ("config", "set", "out", "client-dir"):
        if not isinstance(rc[key], str):
            raise UserError(f"run config {key} must be a string, got {rc[key]!r}")
    for key in ("overwrite", "resume", "allow-recipe-change"):
        if not isinstance(rc[key], bool):
            raise UserError(f"run config {key} must be true or false, got {rc[key]!r}")
    return {**rc, "min-clients": number("min-clients", 0, integer=True),
            "round-timeout": number("round-timeout", 0, strict=True),
            "connect-timeout": number("connect-timeout", 0, strict=True),
            "max-update-norm": number("max-update-norm", 0),
            "max-update-ratio": number("max-update-ratio", 0),
            # below 1 the median client itself would be rejected: a bound is >= 1, and 0 turns it off
            "max-size-ratio": number("max-size-ratio", 1, off=True)}


def resolve_config(run_config: dict) -> RunConfig:
    """The RunConfig of a fresh Flower run from its run config."""
    return build_config(run_config.get("config") or None, parse_overrides(run_config.get("set", "")), defaults="library")


def config_json(cfg: RunConfig) -> str:
    return json.dumps(to_dict(cfg))


def config_from_json(text: str) -> RunConfig:
    return build_config(None, json.loads(text))


def client_names(cfg: RunConfig) -> list[str]:
    """The name of every client (partition-id k is the k-th), on the ServerApp's host: from the
    config (`pflalign.data.clients.names_from_config`), else, for a natural partition of your own
    files by a column without ``data.clients`` or with ``data.client_names=labelled``, read
    off the data (``data.dir``) on this host."""
    from ..data.clients import client_names as names, names_from_config

    known = names_from_config(cfg)
    if known is not None:
        return known
    try:
        return names(cfg)
    except UserError as exc:
        if cfg.data.client_names == "labelled":
            raise UserError(f"the ServerApp names the clients of data.client_names=labelled (each by its most "
                            f"common label) by reading data.dir on its host, and could not: {exc}") from None
        raise UserError(f"the ServerApp names the clients of data.partition=natural (one per value of "
                        f"{cfg.data.partition_by}) by reading data.dir on its host, and could not: {exc}; "
                        "or name them: data.clients=a,b,...") from None


def describe_clients(names: list[str], shown: int = 4) -> str:
    """"N clients (a, b, c, d, ...)": the run's clients for a message, however many there are."""
    listed = ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
    return f"{len(names)} clients ({listed})"
