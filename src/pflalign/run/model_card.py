"""An adapter (or merged model) folder's README.md, as PEFT users expect one beside
``adapter_config.json``: the base, the method and its arguments, LoRA, the data and its partition,
the rounds and the client's scores.
"""

from __future__ import annotations

import json
from pathlib import Path

from .adapter_folder import GLOBAL


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
