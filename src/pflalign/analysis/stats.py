"""The statistics of `pflalign report`: 95% Student-t intervals over seeds, when an interval counts
as evidence, and the paired differences of one method against the others over the seeds both ran
(the seeds share data splits and the initial adapter, so the differences are paired)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..methods import method_order

if TYPE_CHECKING:  # annotations only
    from .runs import Run


def _t_central_mass(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with integer df (Abramowitz & Stegun 26.7.3–4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for k in range(2, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        return math.sin(theta) * total
    total = theta
    if df > 1:
        term = math.sin(theta) * math.cos(theta)
        total += term
        for k in range(3, df - 1, 2):
            term *= c2 * (k - 1) / k
            total += term
    return 2 / math.pi * total


def t_quantile(p: float, df: int) -> float:
    """t_{p, df}: the p-quantile of Student's t (p > 0.5), by bisection on the exact CDF."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError(f"need df >= 1 and 0.5 < p < 1, got df={df}, p={p}")
    mass = 2 * p - 1
    lo, hi = 0.0, 1.0
    while _t_central_mass(hi, df) < mass:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if _t_central_mass(mid, df) < mass:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2


def ci95_half_width(values: list[float]) -> float | None:
    """Half-width of the 95% confidence interval of the mean, t_{0.975, n−1} · s / √n (None for n < 2)."""
    n = len(values)
    if n < 2:
        return None
    return t_quantile(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)


MIN_SEEDS_TO_JUDGE = 3  # fewest values whose 95% interval counts as evidence (a * mark, a claim's interval)


def judgeable(values: list[float]) -> bool:
    """Whether the 95% interval over `values` may be read as evidence: MIN_SEEDS_TO_JUDGE values or
    more, not all equal. From 2 values s rests on one difference, so the interval's coverage hangs
    on that one draw; values that are all equal give s = 0, an interval of width 0 that "excludes"
    every other value, and they happen (scores on a label task move in steps: 2 seeds whose
    differences are both −16.67 read "−16.67 ± 0.00*"). The interval is still shown."""
    return len(values) >= MIN_SEEDS_TO_JUDGE and max(values) - min(values) > 1e-9


def excludes_zero(values: list[float]) -> bool:
    """The 95% interval of the mean of `values` lies clear of 0, judged only where `judgeable`."""
    return judgeable(values) and abs(statistics.fmean(values)) > ci95_half_width(values)


REFERENCE = "pflalign"


def _score(run: Run, task: str | None, metric: str = "rouge_l") -> float | None:
    """A run's personalized `metric` on one client (by task), or its client average (task None)."""
    if task is None:
        return run.results.get(f"avg_{metric}_personalized")
    return next((c.get(f"{metric}_personalized") for c in run.results["clients"] if c["task"] == task), None)


@dataclass
class Paired:
    """Reference minus one baseline over the seeds both ran: mean difference and its paired 95% CI."""

    method: str
    seeds: list[int]
    diffs: dict[str | None, list[float]]  # task (None: the client average) → per-seed differences

    def mean(self, task: str | None) -> float | None:
        return statistics.fmean(self.diffs[task]) if self.diffs.get(task) else None

    def ci(self, task: str | None) -> float | None:
        return ci95_half_width(self.diffs.get(task, []))

    def judged(self, task: str | None) -> bool:
        """Enough seeds, with some spread, for the interval to count (`judgeable`)."""
        return judgeable(self.diffs.get(task, []))

    def significant(self, task: str | None) -> bool:
        """The paired 95% interval excludes 0, where it counts (`excludes_zero`)."""
        return excludes_zero(self.diffs.get(task, []))


def paired_differences(tasks: list[str], runs: list[Run], reference: str = REFERENCE,
                       metric: str = "rouge_l") -> list[Paired]:
    """For each other method, `reference` − method per seed (the seeds share the data split and the
    initial adapter, so the differences are paired), per client and on the client average."""
    ref = {r.seed: r for r in runs if r.method == reference}
    out = []
    for method in method_order(r.method for r in runs):
        if method == reference:
            continue
        pairs = sorted(((ref[r.seed], r) for r in runs if r.method == method and r.seed in ref),
                       key=lambda p: p[1].seed)
        if not pairs:
            continue
        diffs: dict[str | None, list[float]] = {}
        for task in [*tasks, None]:
            values = [(_score(a, task, metric), _score(b, task, metric)) for a, b in pairs]
            if all(x is not None and y is not None for x, y in values):
                diffs[task] = [x - y for x, y in values]
        out.append(Paired(method, [b.seed for _, b in pairs], diffs))
    return out
