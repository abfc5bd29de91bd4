"""`pflalign.analysis.claims`: the paper's five claims judged by the fixed rules, on hand-made runs whose
numbers are chosen so each verdict, interval and qualifier is known by hand."""

import math
from pathlib import Path

import pytest

from pflalign.analysis.claims import (DOES_NOT_HOLD, HOLDS, HOLDS_CLEARLY, NOT_JUDGED, TABLE1_METHODS, TABLE1_SEEDS,
                             claims_markdown, judge, missing_runs)
from pflalign.analysis.report import Run

TASK = "structure_to_text"
T2 = 4.302652729911275  # t_{0.975, 2}: three seeds


def fake_run(method, seed, score, gsnr=(0.3, 0.3), consistency=(0.1,), update_norms=(0.1,), losses=None):
    """One finished run: one client (TASK) with personalized ROUGE-L `score`; its GSNR ratio in
    rounds 1 and 10 (`gsnr`); the rounds' consistency and mean training losses (1.0 each unless
    given); the client's update norms."""
    results = {"method": method, "seed": seed, "avg_rouge_l_personalized": score,
               "clients": [{"id": 0, "task": TASK, "rouge_l_personalized": score}]}
    losses = losses or [1.0] * len(consistency)
    metrics = [{"event": "round", "round": r, "consistency_update_norm": c, "mean_loss": loss}
               for r, (c, loss) in enumerate(zip(consistency, losses))]
    metrics += [{"event": "client_round", "round": r, "client": 0, "update_norm": u}
                for r, u in enumerate(update_norms)]
    metrics += [{"event": "client_round", "round": r, "client": 0, "gsnr_ratio": g}
                for r, g in zip((0, 9), gsnr)]  # 0-based in metrics.jsonl: rounds 1 and 10
    return Run(Path(f"/runs/{method}/seed{seed}"), "flan", method, seed, results, {}, metrics)


def runs_of(scores: dict[str, list[float]], **kwargs) -> list[Run]:
    return [fake_run(m, s, x, **kwargs.get(m, {})) for m, xs in scores.items() for s, x in enumerate(xs)]


def verdict(runs, number):
    return next(v for v in judge(runs, TASK) if v.number == number)


def test_best_average_holds_clearly_only_when_every_paired_interval_is_above_zero():
    # pFLAlign − FedAvg per seed: 2, 3, 4 → mean 3, s = 1, interval 3 ± 4.303/√3 = 3 ± 2.48: above 0
    runs = runs_of({"pflalign": [52, 53, 54], "fedavg": [50, 50, 50]})
    v = verdict(runs, "1")
    assert v.outcome == HOLDS_CLEARLY and "53.00" in v.evidence and "every paired interval is above 0" in v.evidence
    # 1, 5, 3 → mean 3, s = 2, 3 ± 4.97: the interval reaches below 0, so it only holds
    v = verdict(runs_of({"pflalign": [51, 55, 53], "fedavg": [50, 50, 50]}), "1")
    assert v.outcome == HOLDS and f"+3.00 ± {T2 * 2 / math.sqrt(3):.2f}" in v.evidence
    # a method above pFLAlign is named, with its paired difference (−1 each seed: s = 0, ± 0.00)
    v = verdict(runs_of({"pflalign": [52, 53, 54], "fedavg": [50, 50, 50], "feddyn": [53, 54, 55]}), "1")
    assert v.outcome == DOES_NOT_HOLD and ("FedDyn 54.00 (pFLAlign − it: -1.00 ± 0.00 (the same difference in "
                                           "every seed, no spread to judge))") in v.evidence
    assert "FedAvg" not in v.evidence  # below pFLAlign: not named
    # one seed: no interval, so never "clearly"
    assert verdict(runs_of({"pflalign": [52], "fedavg": [50]}), "1").outcome == HOLDS
    assert verdict(runs_of({"fedavg": [50]}), "1").outcome == NOT_JUDGED


def test_fedsa_collapse_needs_an_interval_above_zero_and_falling_below_local():
    # FedAvg − FedSA-LoRA: 10, 12, 14 → 12 ± 4.303·2/√3 = 12 ± 4.97, above 0
    scores = {"fedavg": [50, 52, 54], "fedsa-lora": [40, 40, 40], "local": [45, 45, 45]}
    v = verdict(runs_of(scores), "2")
    assert v.outcome == "holds, a collapse (below Local)"
    assert f"+12.00 ± {T2 * 2 / math.sqrt(3):.2f}" in v.evidence and "FedSA-LoRA 40.00 against Local 45.00" in v.evidence
    assert verdict(runs_of({**scores, "local": [39, 39, 39]}), "2").outcome == "holds, but no collapse (not below Local)"
    # 1, −1, 3 → 1 ± 4.97: the interval is not above 0
    v = verdict(runs_of({**scores, "fedsa-lora": [49, 53, 51]}), "2")
    assert v.outcome == DOES_NOT_HOLD and "(the interval is not above 0)" in v.evidence
    assert verdict(runs_of({"fedavg": [50]}), "2").outcome == NOT_JUDGED
    assert verdict(runs_of({"fedavg": [50], "fedsa-lora": [40], "local": [45]}), "2").outcome == NOT_JUDGED  # one seed


def test_fedsam_and_fedyogi_trail_are_judged_separately():
    runs = runs_of({"fedavg": [50, 52, 54], "fedsam": [44, 45, 46], "fedyogi": [51, 51, 51]})
    assert verdict(runs, "3 (FedSAM)").outcome == HOLDS  # 6, 7, 8 → 7 ± 2.48
    v = verdict(runs, "3 (FedYogi)")  # −1, 1, 3 → 1 ± 4.97
    assert v.outcome == DOES_NOT_HOLD and "+1.00 ± 4.97 (the interval is not above 0)" in v.evidence
    # one seed: no interval, so neither holds nor fails yet (FedAvg − FedSAM = +6)
    v = verdict(runs_of({"fedavg": [50], "fedsam": [44]}), "3 (FedSAM)")
    assert v.outcome == NOT_JUDGED and "+6.00 (one seed, no interval)" in v.evidence


def test_a_diverged_run_counts_and_is_named():
    # FedSAM seed 1's loss ends at 3 × its start (report's test: above 2 ×); the rule still counts its
    # score: FedAvg − FedSAM 6, 40, 8 → 18 ± 4.303·18.7/√3, not above 0
    runs = runs_of({"fedavg": [50, 50, 50], "fedsam": [44, 10, 42]})
    runs[4] = fake_run("fedsam", 1, 10, consistency=(0.1, 0.1), losses=[1.0, 3.0])
    v = verdict(runs, "3 (FedSAM)")
    assert v.outcome == DOES_NOT_HOLD and v.evidence.endswith("; diverged (†), counted as in the table: FedSAM seed 1")
    assert "FedAvg −" in v.evidence and "diverged" not in verdict(runs, "3 (FedYogi)").evidence
    assert "† Diverged runs count in these verdicts" in claims_markdown(runs, TASK)
    assert "† Diverged" not in claims_markdown(runs_of({"fedavg": [50, 50, 50], "fedsam": [44, 10, 42]}), TASK)


def test_gsnr_rises_fastest_needs_the_largest_change_and_a_rise():
    rising = {"pflalign": {"gsnr": (0.2, 0.5)}, "fedavg": {"gsnr": (0.3, 0.4)}}  # +0.3 against +0.1
    v = verdict(runs_of({"pflalign": [50], "fedavg": [50]}, **rising), "4")
    assert v.outcome == HOLDS and "pFLAlign +0.3, the largest other FedAvg +0.1" in v.evidence
    assert "level in round 10: pFLAlign 0.5, the highest other FedAvg 0.4" in v.evidence
    falling = {"pflalign": {"gsnr": (0.5, 0.4)}, "fedavg": {"gsnr": (0.5, 0.2)}}  # falls least: no rise
    assert verdict(runs_of({"pflalign": [50], "fedavg": [50]}, **falling), "4").outcome == DOES_NOT_HOLD
    slower = {"pflalign": {"gsnr": (0.2, 0.3)}, "fedavg": {"gsnr": (0.1, 0.4)}}
    assert verdict(runs_of({"pflalign": [50], "fedavg": [50]}, **slower), "4").outcome == DOES_NOT_HOLD


def test_most_consistent_is_the_highest_mean_consistency_stated_beside_the_update_size():
    """The paper's direction: "personalized initialization substantially increases consistency"."""
    dyn = {"pflalign": {"consistency": (0.05, 0.03), "update_norms": (0.06, 0.02)},
           "fedavg": {"consistency": (0.2, 0.1), "update_norms": (0.3, 0.1)}}
    v = verdict(runs_of({"pflalign": [50, 50], "fedavg": [50, 50]}, **dyn), "5")
    assert v.outcome == DOES_NOT_HOLD
    assert "pFLAlign 0.04, mean update norm ‖w_k − w^r‖ 0.04" in v.evidence and "FedAvg 0.15" in v.evidence
    assert "higher is more consistent" in v.evidence and "not that their directions agree" in v.evidence
    dyn["fedavg"]["consistency"] = (0.01, 0.01)
    assert verdict(runs_of({"pflalign": [50, 50], "fedavg": [50, 50]}, **dyn), "5").outcome == HOLDS


def test_the_verdicts_are_provisional_until_every_run_of_table_1_is_in():
    full = runs_of({m: [50.0] * TABLE1_SEEDS for m in TABLE1_METHODS})
    assert missing_runs(full) == [] and len(full) == 33
    assert claims_markdown(full, TASK).startswith("All 33 runs of Table 1 are in")
    partial = [r for r in full if not (r.method == "fedsam" and r.seed == 2)]
    assert missing_runs(partial) == ["FedSAM seed 2"]
    text = claims_markdown(partial, TASK)
    assert text.startswith("**Provisional**: 32 of Table 1's 33 runs are in (missing: FedSAM seed 2)")
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")][2:]  # under the header
    assert rows == ["| 1", "| 2", "| 3 (FedSAM)", "| 3 (FedYogi)", "| 4", "| 5"]


@pytest.mark.parametrize("number", ["1", "2", "3 (FedSAM)", "3 (FedYogi)", "4", "5"])
def test_no_runs_of_the_needed_methods_is_not_judged(number):
    assert verdict(runs_of({"ffa-lora": [50, 51]}), number).outcome == NOT_JUDGED


def test_an_interval_from_two_seeds_or_without_spread_does_not_count():
    """report.judgeable: 3 seeds or more, differences not all equal. FedAvg − FedSAM 6, 7 over 2 seeds:
    6.5 ± 12.71·0.71/√2 = 6.5 ± 6.35, above 0, yet not judged; 7, 7, 7 over 3 seeds: 7 ± 0.00, not judged."""
    v = verdict(runs_of({"fedavg": [50, 50], "fedsam": [44, 43]}), "3 (FedSAM)")
    assert v.outcome == NOT_JUDGED and "+6.50 ± 6.35 (2 seeds, too few to judge)" in v.evidence
    v = verdict(runs_of({"fedavg": [50, 50, 50], "fedsam": [43, 43, 43], "local": [45, 45, 45]}), "3 (FedSAM)")
    assert v.outcome == NOT_JUDGED and "+7.00 ± 0.00 (the same difference in every seed" in v.evidence
    assert verdict(runs_of({"fedavg": [50, 50, 50], "fedsa-lora": [43, 43, 43]}), "2").outcome == NOT_JUDGED
    # claim 1: pFLAlign − FedAvg 10, 11 → 10.5 ± 6.35, above 0, but from 2 seeds it holds, not clearly
    assert verdict(runs_of({"pflalign": [60, 61], "fedavg": [50, 50]}), "1").outcome == HOLDS
    assert verdict(runs_of({"pflalign": [60, 61, 62], "fedavg": [50, 50, 50]}), "1").outcome == HOLDS_CLEARLY


# ---- Dolly (issue 58): the rules of docs/results/table1-dolly/README.md ---------------------------
from pflalign.analysis.claims import ABOVE, BELOW, NOT_RESOLVED, judge_dolly  # noqa: E402


def dolly_verdict(runs, number):
    return [v for v in judge_dolly(runs) if v.number == number]


def test_dolly_pflalign_at_the_top_means_first_or_second_of_the_papers_rows():
    # second of the paper's rows (FedSA-LoRA above), one paired interval above 0 below it, none below 0
    runs = runs_of({"fedsa-lora": [56, 57, 58], "pflalign": [52, 53, 54], "fedavg": [50, 50, 50],
                    "local": [60, 60, 60]})  # Local is no paper row: it does not push pFLAlign to third
    (v,) = dolly_verdict(runs, "1")
    assert v.outcome == HOLDS_CLEARLY, v
    assert "2 of 3 of the paper's rows (3 of 4 with Local)" in v.evidence and "FedSA-LoRA 57.00" in v.evidence
    # pFLAlign − FedSA-LoRA: −3, −4, −5, an interval below 0: second still, but not clearly
    runs = runs_of({"fedsa-lora": [55, 57, 59], "pflalign": [52, 53, 54], "fedavg": [50, 50, 50]})
    assert dolly_verdict(runs, "1")[0].outcome == HOLDS
    # third: named with the rows above it
    runs = runs_of({"fedsa-lora": [56, 57, 58], "feddyn": [55, 55, 55], "pflalign": [52, 53, 54]})
    (v,) = dolly_verdict(runs, "1")
    assert v.outcome == DOES_NOT_HOLD and "FedDyn 55.00" in v.evidence and "3 of 3" in v.evidence


def test_dolly_fedsa_holds_up_unless_below_fedavg_or_local():
    # FedSA-LoRA − FedAvg: 2, 3, 4 → above 0: holds clearly
    assert dolly_verdict(runs_of({"fedsa-lora": [52, 53, 54], "fedavg": [50, 50, 50]}), "2")[0].outcome == HOLDS_CLEARLY
    # −1, 2, 0.5: mean +0.5, the interval spans 0 → holds
    assert dolly_verdict(runs_of({"fedsa-lora": [49, 52, 50.5], "fedavg": [50, 50, 50]}), "2")[0].outcome == HOLDS
    # −3, −4, −5: below 0 → does not hold
    assert dolly_verdict(runs_of({"fedsa-lora": [47, 46, 45], "fedavg": [50, 50, 50]}), "2")[0].outcome == DOES_NOT_HOLD
    # above FedAvg but below Local: FLAN's collapse test
    v = dolly_verdict(runs_of({"fedsa-lora": [52, 53, 54], "fedavg": [50, 50, 50], "local": [60, 60, 60]}), "2")[0]
    assert v.outcome == DOES_NOT_HOLD and "against Local 60.00" in v.evidence


def test_dolly_step_size_rows_and_whether_flans_reading_carries_over():
    base = {"pflalign": [50, 50, 50], "fedavg": [51, 51, 51], "feddyn": [54, 54, 54]}
    # pFLAlign at lr 0.33 − pFLAlign: 2, 3, 4 → above 0: carries over; FedAvg at 0.16 − FedAvg: 0, 1, −1 → not resolved
    runs = runs_of({**base, "pflalign@lr=0.33": [52, 53, 54], "fedavg@lr=0.16": [51, 52, 50]})
    by = {(v.number, v.claim): v for v in judge_dolly(runs)}
    s1 = next(v for (n, _), v in by.items() if n == "S1")
    assert s1.outcome == ABOVE and s1.evidence.startswith("+3.00 ± ")
    s3 = next(v for (n, _), v in by.items() if n == "S3")
    assert s3.outcome == NOT_RESOLVED
    s = next(v for (n, _), v in by.items() if n == "S")
    assert s.outcome == "carries over" and "(53.00) would be 2 of 3 in Table 1" in s.evidence
    # 1, −1, 3: mean +1, spanning 0 → in part; −2, −3, −4 → does not carry over
    assert next(v for v in judge_dolly(runs_of({**base, "pflalign@lr=0.33": [51, 49, 53]})) if v.number == "S").outcome \
        == "in part"
    worse = runs_of({**base, "pflalign@lr=0.33": [48, 47, 46]})
    assert next(v for v in judge_dolly(worse) if v.number == "S1").outcome == BELOW
    assert next(v for v in judge_dolly(worse) if v.number == "S").outcome == "does not carry over"
    assert "| S1 |" in claims_markdown(runs, TASK, "dolly") and "| S1 |" not in claims_markdown(runs, TASK)
