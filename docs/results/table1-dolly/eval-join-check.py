"""Did the generation loop's join bug (fixed in 53d7a04) touch a paper run's scores?

The bug: when the running group of prompts had no padding (every prompt the same length after
the shared prefix, so no mask) and a longer group joined it, the running rows' new left padding
was left unmasked. The evaluation sorts a client's test prompts by length and prefills them
`eval.batch_size` at a time, so it could strike only where such a group of equal lengths exists.
This lists, for every client of the paper presets (and the demo), the groups whose prompts all
have one length; none means no score of that federation was touched (the Dolly grid runs code
from before the fix, and FLAN's Table 1 was made before it).

    .venv/bin/python docs/results/table1-dolly/eval-join-check.py ../shared/data
"""

import sys
from pathlib import Path

from pflalign.config import build_config
from pflalign.data.clients import client_shares
from pflalign.evaluate import _shared_prefix
from pflalign.model import load_base_model
from pflalign.prompts import encode_prompt

data = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data")
_, tok = load_base_model("smollm2-135m")
for preset, source in (("flan-paper", data / "flan"), ("dolly-paper", data / "dolly/databricks-dolly-15k.jsonl"),
                       ("demo", None)):
    cfg = build_config(preset, {"data": {"dir": str(source)}} if source else {})
    for share in client_shares(cfg):
        prompts = sorted((encode_prompt(tok, ex, cfg.max_seq_len, cfg.data.template)[0] for ex in share.test), key=len)
        prefix = _shared_prefix(prompts)
        size = cfg.eval.batch_size
        groups = [prompts[a:a + size] for a in range(0, len(prompts), size)]
        equal = [g for g, group in enumerate(groups) if len({len(p) - prefix for p in group}) == 1]
        joined = [g for g in equal if g + 1 < len(groups)]  # a later group can join only a group before the last
        print(f"{preset} {share.name}: {len(prompts)} prompts in {len(groups)} groups of {size}; "
              f"groups of one length: {equal or 'none'}; of those joined later: {joined or 'none'}")
