"""The evaluation's batch on a GPU (issue 39's bill is mostly evaluation): greedy generation
tokens/s of LLaMA-3.2-1B's architecture (random weights, bf16, the adapter merged, as the final
evaluation runs) at eval.batch_size 64 (the default), 128, 200 (one FLAN client's whole test
split) and 256, with `new_tokens` tokens per row and no EOS (the upper bound).

    PYTHONPATH=src python3 benchmarks/gpu_eval_batch.py --out benchmarks/results/gpu_eval_batch.json
    PYTHONPATH=src python3 benchmarks/gpu_eval_batch.py --device cpu --out /tmp/b.json   # toy sizes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (the device check's model builder and timer)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    tiny = args.device == "cpu"
    lm, config = gpu.build_arch("llama-3.2-1b", args.device, tiny)
    rows_list, new_tokens = ((4, 8), 4) if tiny else ((64, 128, 200, 256), gpu.EVAL_NEW_TOKENS)
    out = {"model": "llama-3.2-1b", "device": args.device, "new_tokens": new_tokens, "prompt_tokens": 96,
           "rows": {}}
    for rows in rows_list:
        out["rows"][rows] = gpu.time_generation(lm, config, args.device, rows, 96 if not tiny else 16, new_tokens)
        print(rows, json.dumps(out["rows"][rows]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
