"""Optional TensorBoard logging (``--set log.tensorboard=true``, extra ``pflalign[tensorboard]``).

`wrap` puts a tee in front of the run's `MetricsLog`: every line still goes to
metrics.jsonl unchanged, and the numbers also go to TensorBoard event files in
``<run>/tensorboard/``, with the round (1-based) as the step unless said:

* the run's config: every key as a hyperparameter of the HParams dashboard (``lora.r``,
  ``method_args.beta``, ...; lists joined by commas, None as "None", booleans "true"/"false"), with
  ``final/avg_rouge_l_personalized``, ``final/avg_rouge_l_global`` and ``loss/mean`` as its
  metrics, and the whole config.json as the text ``config``;
* ``loss/step/<client>``: each local step's minibatch loss (``train_step`` lines), the step
  counted over all rounds, round · local_steps + step + 1, as the report's loss figure;
* ``loss/mean`` and ``consistency/update_norm``, ``consistency/model_norm`` (``round`` lines), and
  ``lr``, the clients' learning rate of the round (`optim.round_lr`: optimizer.schedule);
* ``loss/<client>`` (the mean of its local steps), ``gsnr/mean/<client>``, ``gsnr/ratio/<client>``
  (``client_round`` lines);
* ``rouge_l/{personalized,global}/<client>`` (``round_eval`` lines, with ``eval.every``);
* ``final/<avg key>`` at the last round (the ``eval`` line).

Both engines write them: ``pflalign run`` and the Flower ServerApp (its clients' losses come back
with their updates). ``tensorboard --logdir runs/`` then shows a 50-round run as it goes. A
resumed run writes a new event file; TensorBoard shows the newest value of a step.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError
from .settings import to_dict

FOLDER = "tensorboard"


def available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


HPARAM_METRICS = ("final/avg_rouge_l_personalized", "final/avg_rouge_l_global", "loss/mean")


def hparams_of(config: dict, prefix: str = "") -> dict[str, int | float | str | bool]:
    """The config as flat hyperparameters ("lora.r": 16): the HParams plugin takes numbers and
    strings, so a list becomes "a,b", None "None" and a boolean "true" or "false", as --set spells
    it (torch's `hparams` would record a boolean as the number 1 or 0)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(hparams_of(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(map(str, value))
        elif isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, (int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


class TensorBoardTee:
    """A `MetricsLog` that also writes scalars to TensorBoard (see the module docstring)."""

    def __init__(self, metrics, folder: Path, names: dict[int, str] | None = None, config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self._metrics = metrics
        self._writer = SummaryWriter(log_dir=str(folder))
        self._names = names or {}
        self._losses: dict[tuple[int, int], list[float]] = {}
        self._last_round = 0
        self._local_steps = int((config or {}).get("local_steps") or 1)
        self._config = config or {}
        if config is not None:
            self._hparams(config)

    def _hparams(self, config: dict) -> None:
        """The config for the HParams dashboard, written into this run's own event file (as
        `SummaryWriter.add_hparams` does, but without its extra sub-run), and as text."""
        from torch.utils.tensorboard.summary import hparams

        writer = self._writer._get_file_writer()
        for summary in hparams(hparams_of(config), dict.fromkeys(HPARAM_METRICS, 0.0)):
            writer.add_summary(summary)
        self._writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```")

    def _name(self, client) -> str:
        return self._names.get(client, f"client{client}")

    def _scalar(self, tag: str, value, step: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._writer.add_scalar(tag, value, step)

    def write(self, **row) -> None:
        self._metrics.write(**row)
        event = row.get("event")
        if event == "train_step":
            self._losses.setdefault((row["round"], row["client"]), []).append(row["loss"])
            self._scalar(f"loss/step/{self._name(row['client'])}", row["loss"],
                         row["round"] * self._local_steps + row["step"] + 1)
            return
        if event == "eval":
            for key, value in row.items():
                if key.startswith("avg_"):
                    self._scalar(f"final/{key}", value, self._last_round)
            return
        if "round" not in row:
            return
        step = row["round"] + 1
        self._last_round = max(self._last_round, step)
        if event == "round":
            self._scalar("loss/mean", row.get("mean_loss"), step)
            self._scalar("consistency/update_norm", row.get("consistency_update_norm"), step)
            self._scalar("consistency/model_norm", row.get("consistency_model_norm"), step)
            self._scalar("lr", self._round_lr(row["round"]), step)
        elif event == "client_round":
            name = self._name(row["client"])
            losses = self._losses.pop((row["round"], row["client"]), [])
            if losses:
                self._scalar(f"loss/{name}", sum(losses) / len(losses), step)
            self._scalar(f"gsnr/mean/{name}", row.get("gsnr_mean"), step)
            self._scalar(f"gsnr/ratio/{name}", row.get("gsnr_ratio"), step)
        elif event == "round_eval":
            name = row.get("task") or self._name(row["client"])
            self._scalar(f"rouge_l/personalized/{name}", row.get("rouge_l_personalized"), step)
            self._scalar(f"rouge_l/global/{name}", row.get("rouge_l_global"), step)

    def _round_lr(self, round_index: int) -> float | None:
        """The clients' lr of a round, from the config as config.json holds it (None without one)."""
        from .optim import round_lr
        from .settings import OptimizerConfig

        cfg = self._config
        if not isinstance(cfg.get("lr"), (int, float)) or not isinstance(cfg.get("rounds"), int):
            return None
        opt = {**vars(OptimizerConfig()), **(cfg.get("optimizer") or {})}
        return round_lr(cfg["lr"], opt["schedule"], opt["min_lr"], cfg["rounds"], round_index)

    def commit(self) -> int:
        self._writer.flush()
        return self._metrics.commit()

    def rollback(self, offset: int) -> None:
        self._metrics.rollback(offset)

    def close(self) -> None:
        self._writer.close()
        self._metrics.close()


def check(cfg) -> None:
    """Fail early when TensorBoard logging is asked for without its package."""
    if getattr(getattr(cfg, "log", None), "tensorboard", False) and not available():
        raise UserError("log.tensorboard=true needs TensorBoard: pip install 'pflalign[tensorboard]'")


def wrap(metrics, cfg, out: Path, names: dict[int, str] | None = None):
    """`metrics` as it is, or teed to TensorBoard when ``log.tensorboard`` is on; `names`: client id →
    name, for the tags."""
    if not getattr(getattr(cfg, "log", None), "tensorboard", False):
        return metrics
    check(cfg)
    return TensorBoardTee(metrics, Path(out) / FOLDER, names, to_dict(cfg))  # config.json's keys
