"""Numbers a run and its report both compute from the same lines: the training loss a run
started from, the ratio past which it counts as diverged, and how a score spreads over the
clients. Here, below both, so that `pflalign.analysis.report` reads run folders without importing the
run's lifecycle (and with it the training code); see tests/test_layers.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def _train_steps(rows):
    for row in rows:
        if row.get("event") == "train_step" and isinstance(row.get("client"), int) \
                and isinstance(row.get("round"), int) and isinstance(row.get("loss"), (int, float)):
            yield row


# A client whose round's mean step loss passes this multiple of its own early level (`early_level`) blew
# up (`client_blowups`). Over the 708 clients of the 170 runs under docs/results (2026-11-28), the
# clients that held peaked at most 2.41 × their early level, those that blew up at 7.6 × or more: the
# line at 4 lies in the gap, and batch-4 noise (a round's mean against one lucky first batch: 1.79
# against 0.832, issue 56) does not reach it.
CLIENT_BLOWUP_RATIO = 4.0


def early_level(losses: list[float]) -> float:
    """A client's early level: the median of its step losses in the first round it trained. A median
    of a round, as a round's mean is what it is compared with: one lucky or unlucky batch moves it
    little (a single first step did: batch 4 on a user's CSV, 0.832 against a round mean of 1.79), and
    a blow-up in the round's last steps does not lift it (FedSAM ρ = 0.5 on FLAN, seed 1: 2.5 → 92
    within round 1). A non-finite loss counts as the highest."""
    values = sorted(x if math.isfinite(x) else math.inf for x in losses)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def client_starts(rows) -> dict[int, float]:
    """Each client's early level (`early_level` of its first round's train_step lines, in file order).
    Only a level that `judgeable_start` accepts is judged: the report and LossWatch share both."""
    firsts: dict[int, tuple[int, list[float]]] = {}
    for row in _train_steps(rows):
        c, r = row["client"], row["round"]
        first_round, losses = firsts.setdefault(c, (r, []))
        if r == first_round:
            losses.append(float(row["loss"]))
    return {c: early_level(losses) for c, (_, losses) in firsts.items()}


def judgeable_start(start: float) -> bool:
    """A client's early level that a ratio can be taken to: finite and above 0."""
    return math.isfinite(start) and start > 0


@dataclass(frozen=True)
class ClientBlowup:
    """One client whose local training blew up for a while (`client_blowups`); rounds 1-based."""

    client: int
    start: float  # its early level (`early_level`: the median step loss of its first round)
    from_round: int  # the first round whose mean step loss passed CLIENT_BLOWUP_RATIO × start
    peak: float  # its highest round mean step loss, in round `peak_round`
    peak_round: int
    last: float  # its mean step loss in the last round it trained


def client_blowups(rows) -> list[ClientBlowup]:
    """The clients whose mean local-step loss in some round (their first included) passed
    CLIENT_BLOWUP_RATIO × their own early level, in client order.

    Why per client beside the run's test (report's `divergence`): a run's mean loss hides one client's
    blow-up among many, and a client that blows up and comes back down does not end the run above the
    line. Local at lr 0.16 on FLAN (issue 38): one or two of 4 clients went to 14–159 × their start,
    each run ended at 0.6–1.4 × its start. A non-finite loss counts as above the line.

    `rows`: a run's metrics lines (train_step lines are read, in file order)."""
    rows = list(rows)
    starts = {c: start for c, start in client_starts(rows).items() if judgeable_start(start)}
    sums: dict[int, dict[int, list[float]]] = {}  # client → round → [sum of losses, steps]
    for row in _train_steps(rows):
        c, r, loss = row["client"], row["round"], row["loss"]
        if c in starts:
            acc = sums.setdefault(c, {}).setdefault(r, [0.0, 0])
            acc[0] += loss if math.isfinite(loss) else math.inf
            acc[1] += 1
    found = []
    for c in sorted(starts):
        means = [(r + 1, total / n) for r, (total, n) in sorted(sums[c].items())]
        above = [(r, m) for r, m in means if m > CLIENT_BLOWUP_RATIO * starts[c]]
        if above:
            peak_round, peak = max(above, key=lambda rm: rm[1])
            found.append(ClientBlowup(c, starts[c], above[0][0], peak, peak_round, means[-1][1]))
    return found


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
