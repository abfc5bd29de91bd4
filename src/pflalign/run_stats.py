"""Numbers a run and its report both compute from the same lines: the training loss a run
started from, the ratio past which it counts as diverged, and how a score spreads over the
clients. Here, below both, so that `pflalign.analysis.report` reads run folders without importing the
run's lifecycle (and with it the training code); see tests/test_layers.py.
"""

from __future__ import annotations

import math

import numpy as np

# A run whose mean training loss passes this multiple of the loss it started from (`start_loss`) has
# diverged: on FLAN the committed healthy runs end at 0.21–0.43 × it (10 and 50 rounds; pFLAlign at
# β = 0.99, which barely moves, 0.92 ×), the diverged ones at 2.5–6.0 × (docs/results/table1-flan,
# tune-flan). `lifecycle.LossWatch` warns when a round passes it; `pflalign report` marks a run whose last
# round ends above it.
DIVERGED_LOSS_RATIO = 2.0


def start_loss(rows) -> float | None:
    """The training loss a run started from: the mean over round 1's clients of their first local
    step's loss, taken before any update of the run. Not round 1's mean loss: a run can blow up within
    round 1 (FedSAM ρ = 0.5 on FLAN, seed 1: one client's loss 2.5 → 92 in its 5 steps, round 1's mean
    6.6 against a start of 2.1), and a reference that holds the blow-up hides it. Round 1's mean loss
    where the metrics have no train_step lines; None without either.

    `rows`: a run's metrics lines; in file order they are read only up to round 1's `round` line."""
    firsts, round1 = [], None
    for row in rows:
        r = row.get("round")
        if round1 is not None and isinstance(r, int) and r > 0:
            break  # round 1's line comes after its steps
        loss = row.get("loss") if row.get("event") == "train_step" else row.get("mean_loss")
        if r != 0 or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            continue
        if row.get("event") == "train_step" and row.get("step") == 0:
            firsts.append(float(loss))
        elif row.get("event") == "round":
            round1 = float(loss)
    return sum(firsts) / len(firsts) if firsts else round1



def distribution(rows: list[dict], key: str) -> dict | None:
    """How a score spreads over the scored clients, not only its mean: mean, |D_k|-weighted mean
    (|D_k|: training examples), the mean of the worst 10% of clients (at least one), min, median
    and max. None when no client has the score."""
    pairs = [(r[key], r["n_train"]) for r in rows if r[key] is not None]
    if not pairs:
        return None
    values = np.array([v for v, _ in pairs], dtype=float)
    sizes = np.array([n for _, n in pairs], dtype=float)
    worst = np.sort(values)[:max(1, int(np.ceil(0.1 * len(values))))]
    return {"clients": len(values), "mean": float(values.mean()),
            "weighted_mean": float((values * sizes).sum() / sizes.sum()),
            "worst_10pct_mean": float(worst.mean()), "min": float(values.min()),
            "median": float(np.median(values)), "max": float(values.max())}
