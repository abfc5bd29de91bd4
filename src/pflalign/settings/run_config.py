"""The run configuration's keys and the paper's defaults: `RunConfig` and its sections (plain
dataclasses), the methods' and optimizers' names, the presets, and `to_dict` (the config as
config.json holds it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class LoraSettings:
    """LoRA hyperparameters. Paper: r=16, alpha=32; it does not name the target
    modules, so we adapt every linear projection of attention and MLP
    (PEFT's ``all-linear``: q/k/v/o + gate/up/down on Llama, q/k/v/out + fc1/fc2 on OPT)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class DataColumns:
    """data.name=files: which column of your data is what (pflalign.data.files)."""

    instruction: str = "instruction"
    response: str = "response"
    context: str | None = None  # optional: appended to the instruction as "\n\nContext:\n..."


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic | dolly | flan | files
    dir: str | None = None  # dolly: .jsonl file, folder or hub id; flan: FedDPA folder; files: file, folder or hub id
    clients: list[str] | None = None  # categories, one client each; None: the paper's 4
    split_seed: int = 42  # Dolly's train/test split; fixed across run seeds
    seed: int | None = None  # the partitioners' draws (shuffle, Dirichlet, shards); None: split_seed, as before
    max_train: int | None = None  # keep the first N training examples per client
    max_test: int | None = None  # evaluate on the first N test examples per client
    validation: int | None = None  # hold out N training examples per client and evaluate on them (tuning)
    # Partitions and your own data (pflalign.data.partition / files / federate); the defaults are
    # today's federations: one client per category, Dolly's seeded 10% and FLAN's test.jsonl test sets.
    columns: DataColumns = field(default_factory=DataColumns)
    partition: str = "natural"  # natural | iid | dirichlet | shard | linear | exponential | square
    partition_by: str | None = None  # the column naming a client (natural) or a label (dirichlet, shard)
    num_clients: int | None = None  # every partition but natural
    alpha: float | None = None  # dirichlet: concentration, > 0; smaller is more label skew
    min_partition_size: int | None = None  # fewest rows per client (dirichlet redraws; default 10 there, else 1)
    shards_per_client: int | None = None  # shard: default 2
    test_set: str = "auto"  # auto | per_client | global (pflalign.data.federate)
    test_fraction: float = 0.1  # per_client / global hold-out: ceil(fraction x rows), seeded by split_seed
    drop_empty: bool = False  # files: drop (and count) rows with an empty instruction, response or label
    client_names: str = "numbered"  # numbered: client_000, ...; labelled: client_000-<its most common label>
    template: str = "chat"  # chat: the tokenizer's chat template (plain when it has none); plain: always plain (base models)


@dataclass
class EvalConfig:
    max_new_tokens: int = 128
    # rows decoded together, or auto (evaluate.decode_plan: 64 on CPU, on CUDA up to 1024 within half the
    # free memory); unset: 64 on device=cpu (where decoding 64 rows costs ~2x one row per token, measured),
    # auto on cuda or auto (settings.defaults.resolve_defaults writes which into config.json)
    batch_size: int | str | None = None
    base_model: bool = True  # also score the untrained base model
    every: int = 0  # also score every N rounds (ROUGE-L curves); 0: only at the end
    every_max_test: int | None = 20  # test examples per client for those per-round scores; None: all
    clients: int | None = None  # score a seeded sample of this many clients (many clients); None: all


@dataclass
class LogConfig:
    tensorboard: bool = False  # also log per-round scalars to <out>/tensorboard (extra: pflalign[tensorboard])


# The methods' names in `pflalign.methods.REGISTRY`'s order (a test keeps the two equal): a typo in
# `method` is refused here, before the methods (and torch, transformers: seconds) are imported.
METHOD_NAMES = ("pflalign", "pflalign-no-precond", "pflalign-no-correction", "pflalign-const-gamma",
                "pflalign-hard-gamma", "pflalign-no-personal-init", "fedavg", "fedprox", "fedsam", "scaffold",
                "feddyn", "fedadam", "fedyogi", "fedadagrad", "fedgloss", "local", "ffa-lora", "fedsa-lora", "fedsvd")
OPTIMIZERS = ("sgd", "adamw")  # optimizer.name (pflalign.optim)
SCHEDULES = ("constant", "cosine")  # optimizer.schedule


@dataclass
class OptimizerConfig:
    """The clients' local optimizer, the learning rate across rounds and gradient accumulation
    (pflalign.optim says what each means). Written to config.json only when it differs from
    these defaults (`to_dict`), so a default run's config.json is the one it was before."""

    name: str = "sgd"  # sgd (the paper's) | adamw (OpenFedLLM's, FlowerTune's); moments reset every round
    beta1: float = 0.9  # adamw
    beta2: float = 0.999  # adamw
    eps: float = 1e-8  # adamw
    weight_decay: float = 0.0  # adamw, decoupled (the HF Trainer's default 0)
    schedule: str = "constant"  # constant | cosine (torch's CosineAnnealingLR over rounds, towards min_lr)
    min_lr: float = 0.0  # cosine: the lr it decays towards, reached one round after the last (pflalign.optim)
    grad_accumulation: int = 1  # microbatches of batch_size per local step


@dataclass
class RunConfig:
    method: str = "pflalign"
    method_args: dict = field(default_factory=dict)
    model: str = "smollm2-135m"
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rounds: int = 50
    local_steps: int = 5
    batch_size: int = 4
    lr: float | None = None  # None: `default_lr` (by method, optimizer and `defaults`; issue 56)
    max_seq_len: int = 1024
    seed: int = 0
    participation: float = 1.0  # fraction of clients per round, sampled with the seed
    device: str = "cpu"  # cpu | cuda | auto
    dtype: str = "float32"  # float32 | bfloat16 (GPU)
    # which defaults fill a key the config leaves unset (`resolve_defaults`): "paper" or "library".
    # Not written to config.json: what it filled is (lr, pFLAlign's beta), so a run reads back the same;
    # not compared either: two configs with the same values are the same run whichever filled them.
    defaults: str = field(default="paper", compare=False)


PRESETS: dict[str, dict] = {
    # The embedded default: SmolLM2-135M on the synthetic 4-task federation, a few minutes on 2 cores.
    "demo": {
        "method": "pflalign",
        "model": "smollm2-135m",
        "data": {"name": "synthetic", "max_train": 64, "max_test": 16},
        "rounds": 4,
        "local_steps": 5,
        "max_seq_len": 256,
        "eval": {"max_new_tokens": 24},
    },
    # The paper's settings (Kim & Lee 2026): 4 clients, 50 rounds x 5 steps, batch 4, lr 4e-2, r=16,
    # with the paper defaults (pFLAlign's beta 0.9, as every run before issue 56).
    "flan-paper": {"data": {"name": "flan"}, "eval": {"max_new_tokens": 128}, "defaults": "paper"},
    "dolly-paper": {"data": {"name": "dolly"}, "eval": {"max_new_tokens": 128}, "defaults": "paper"},
}


def to_dict(cfg: RunConfig) -> dict:
    """The config as written to config.json. The `optimizer` section and `data.client_names`
    (issue 42) only when they differ from their defaults: a default run's config.json (and so
    the pinned results' hash of it) stays what it was before they existed; reading it back
    gives the defaults."""
    out = dataclasses.asdict(cfg)
    del out["defaults"]  # what they filled in is written (lr, method_args)
    if cfg.optimizer == OptimizerConfig():
        del out["optimizer"]
    if cfg.data.client_names == "numbered":
        del out["data"]["client_names"]
    return out
