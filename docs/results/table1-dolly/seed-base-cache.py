"""Fill a fresh machine's cache of the base model's generations from a committed run.

The base model's generations are the same in every run of one data split (model/base_cache.py),
and each committed run keeps them (predictions.jsonl.gz, key "base"). A new machine starts with an
empty cache, so its first run would generate them again: about 15-25 minutes of both cores on
Dolly. This writes them into the cache under the key the code that runs them computes (base
weights, the prompts' token ids, max_new_tokens, batch size, dtype, device, torch, transformers
and the package's source), so a run whose key differs in any of these still generates afresh.

    PYTHONPATH=path/to/grid/src .venv/bin/python docs/results/table1-dolly/seed-base-cache.py RUN_FOLDER

RUN_FOLDER: a committed run (config.json and predictions.jsonl.gz). Prints each client's cache file.
"""
import gzip
import json
import sys
from pathlib import Path

from pflalign.config import load_saved_config
from pflalign.model.base_cache import base_generations
from pflalign.prompts import encode_prompt
from pflalign.run.engine import Federation


def main(folder: Path) -> None:
    cfg = load_saved_config(folder / "config.json")
    rows = [json.loads(line) for line in gzip.open(folder / "predictions.jsonl.gz", "rt")]
    fed = Federation(cfg, progress=False)
    try:
        for k in fed.eval_ids:
            test = fed.clients[k].data.test
            mine = [r for r in rows if r["client"] == k]
            # the committed rows are the client's test split in order: check it before trusting them
            if [r["prompt"] for r in mine] != [ex.prompt for ex in test]:
                sys.exit(f"client {k}: the committed prompts are not this split's; nothing written")
            prompts = [encode_prompt(fed.lm.tokenizer, ex, cfg.max_seq_len, cfg.data.template)[0] for ex in test]
            outs = [r["base"] for r in mine]

            def committed():
                return outs

            got = base_generations(fed.lm, prompts, cfg.eval.max_new_tokens, cfg.eval.batch_size, committed)
            same = "cached now" if got is outs else "already cached, equal" if got == outs else "ALREADY CACHED, DIFFERENT"
            print(f"client {k} ({fed.clients[k].name}): {len(outs)} generations, {same}")
    finally:
        fed.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
