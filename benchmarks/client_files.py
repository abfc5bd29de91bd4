"""What a round costs outside training and scoring: each client's record written to and read back
from its file (run/client_store.py), and the run's checkpoint, at the real adapters' sizes (issue 55).

    .venv/bin/python benchmarks/client_files.py --out benchmarks/results/client-files-cpu.json

Per architecture (LoRA r16 on every linear layer, shapes from the model's configuration on the
meta device: no weights) and per method of Table 1 (its client state as `init_client_state`
makes it, plus the personalized adapter): the bytes of a client's file, and the seconds of a
client round's record kept two ways, median of REPEATS:

- ``files``: `ClientStore.save` (encode, atomic write with fsync, sha256; ``files_save_s``) and the
  next round's `ClientStore.load` (read, sha256, decode; ``files_load_s``): what every round did
  for every client before 2026-11-28, and still does on the CPU, where a checkpoint follows every
  round;
- ``memory``: the same store holding the record in memory (`memory_bytes`, with
  ``--checkpoint-every`` > 0: CUDA's default), its load a copy; the files are written at the
  checkpoints only.

And the run checkpoint (`save_run_checkpoint`: w^r and the server's state, atomic, two kept).
`table1` projects both ways over Table 1 (11 methods x 3 seeds, 50 rounds, 4 clients): minutes of
record keeping that no GPU bill counted. Run on the device's host by gpu.py's ``files`` section
(CUDA tensors: the encode copies them to the host), here on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

TABLE1_METHODS = ("pflalign", "fedavg", "fedprox", "fedsam", "scaffold", "feddyn", "fedyogi", "fedgloss",
                  "ffa-lora", "fedsa-lora", "fedsvd")
SEEDS, ROUNDS, CLIENTS = 3, 50, 4
REPEATS = 3


def lora_shapes(arch: str, r: int = 16) -> dict[str, tuple[int, ...]]:
    """PEFT-named LoRA A/B shapes of `arch` (gpu.ARCHS) at rank r on every linear layer but the head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpu import ARCHS

    spec = dict(ARCHS[arch])
    family = spec.pop("family")
    config = AutoConfig.for_model(family, **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            prefix = f"base_model.model.{name}"
            shapes[f"{prefix}.lora_A.default.weight"] = (r, module.in_features)
            shapes[f"{prefix}.lora_B.default.weight"] = (module.out_features, r)
    return shapes


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def measure(device: str = "cpu", archs=("smollm2-135m", "llama-3.2-1b"), methods=TABLE1_METHODS,
            repeats: int = REPEATS) -> dict:
    from pflalign import checkpoint as ckpt
    from pflalign import params as P
    from pflalign.methods import METHODS
    from pflalign.run.client_store import ClientStore
    from pflalign.settings.defaults import CLIENT_MEMORY_BYTES

    out: dict = {"device": device, "torch": torch.__version__, "repeats": repeats}
    for arch in archs:
        shapes = lora_shapes(arch)
        gen = torch.Generator().manual_seed(0)
        adapter = P.moved(P.clone({n: torch.randn(s, generator=gen) * 0.01 for n, s in shapes.items()}), device)
        order = list(adapter)
        row: dict = {"lora_tensors": len(adapter), "adapter_mb": sum(t.numel() * 4 for t in adapter.values()) / 1e6}
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            for method_name in methods:
                method = METHODS[method_name]()
                state = method.init_client_state(adapter)
                cells = {"file_mb": (sum(t.numel() * 4 for g in state.values() for t in g.values())
                                     + sum(t.numel() * 4 for t in adapter.values())) / 1e6}
                for mode, memory in (("files", 0), ("memory", CLIENT_MEMORY_BYTES)):
                    store = ClientStore(run_dir / mode / method_name, ["c"], memory_bytes=memory)
                    store.folder.mkdir(parents=True)
                    rounds = iter(range(1, 10_000))
                    saves, loads = [], []

                    def client_round():  # this round's record kept, read back at the next round's start
                        tic = time.perf_counter()
                        store.save(0, next(rounds), state, adapter)
                        saves.append(time.perf_counter() - tic)
                        store.load(0, device, order)
                        if device.startswith("cuda"):
                            torch.cuda.synchronize()
                        loads.append(time.perf_counter() - tic - saves[-1])

                    client_round()
                    cells[f"{mode}_s"] = _median_seconds(client_round, repeats)
                    cells[f"{mode}_save_s"], cells[f"{mode}_load_s"] = (statistics.median(saves[1:]),
                                                                        statistics.median(loads[1:]))
                server_state = method.init_server_state(adapter)
                checkpoints = iter(range(1, 10_000))
                ckpt_dir = run_dir / "ckpt" / method_name
                ckpt_dir.mkdir(parents=True)
                cells["checkpoint_s"] = _median_seconds(
                    lambda: ckpt.save_run_checkpoint(ckpt_dir, {"rounds_done": next(checkpoints), "global": adapter,
                                                                "server_state": server_state, "metrics_offset": 0}),
                    repeats)
                row[method_name] = cells
                print(f"{arch:13s} {method_name:10s} file {cells['file_mb']:6.1f} MB: files {cells['files_s']:.3f} s, "
                      f"memory {cells['memory_s']:.3f} s a client round; checkpoint {cells['checkpoint_s']:.3f} s",
                      flush=True)
        every_round = sum(SEEDS * ROUNDS * (CLIENTS * row[m]["files_s"] + row[m]["checkpoint_s"]) for m in methods)
        in_memory = sum(SEEDS * ROUNDS * CLIENTS * row[m]["memory_s"] for m in methods)
        row["table1"] = {
            "doc": (f"minutes over {len(methods)} methods x {SEEDS} seeds x {ROUNDS} rounds x {CLIENTS} clients: "
                    "every_round_minutes = each client's record to and from its file and the checkpoint every round "
                    "(the CPU's default); in_memory_minutes = the records' copies in memory, checkpoints left out "
                    "(one every 60 s on CUDA: add a checkpoint and 4 files' writes per minute of training)"),
            "every_round_minutes": every_round / 60, "in_memory_minutes": in_memory / 60}
        out[arch] = row
        print(f"{arch}: Table 1's record keeping {every_round / 60:.1f} min every round, {in_memory / 60:.2f} min "
              "in memory", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "client-files-cpu.json"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--archs", default="smollm2-135m,llama-3.2-1b")
    args = parser.parse_args(argv)
    report = {"doc": __doc__, **measure(args.device, tuple(args.archs.split(",")))}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
