"""docs/results/pflalign-analysis/answers.py: issue 38's fixed rules applied to made-up runs, one
test per verdict, so that the answers the grid's runs get are the rules' and nobody's reading."""

import importlib.util
import json
from pathlib import Path

import pytest

from pflalign import checkpoint as ckpt

HERE = Path(__file__).resolve().parents[1] / "docs" / "results" / "pflalign-analysis"


@pytest.fixture(scope="module")
def answers():
    spec = importlib.util.spec_from_file_location("issue38_answers", HERE / "answers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def put(root: Path, name: str, avgs: list[float], curve: dict[int, float] | None = None,
        global_avgs: list[float] | None = None) -> None:
    """Runs of `name` (seeds 0, 1, ... with these Avgs) under root/flan/, as the grid writes them;
    `curve`: round → personalized ROUGE-L of its round_eval lines (two clients, both that value);
    `global_avgs`: the global model's Avg per seed (a rescoring keeps its source's)."""
    for seed, avg in enumerate(avgs):
        d = root / "flan" / name / f"seed{seed}"
        d.mkdir(parents=True)
        method = name.split("@")[0]
        glob = {"avg_rouge_l_global": global_avgs[seed]} if global_avgs else {}
        (d / ckpt.RESULTS).write_text(json.dumps({
            "method": method, "seed": seed, "avg_rouge_l_personalized": avg, **glob,
            "clients": [{"id": 0, "task": "t", "rouge_l_personalized": avg}]}))
        (d / ckpt.CONFIG).write_text("{}")
        lines = [{"event": "round_eval", "round": r - 1, "client": c, "task": "t", "rouge_l_personalized": v}
                 for r, v in (curve or {}).items() for c in (0, 1)]
        (d / ckpt.METRICS).write_text("".join(json.dumps(m) + "\n" for m in lines))


def table1(root: Path, pflalign=(48.0, 48.0, 48.0), fedavg=(49.0, 49.0, 49.0)) -> Path:
    put(root, "pflalign", list(pflalign))
    put(root, "fedavg", list(fedavg))
    for name, value in (("feddyn", 51.0), ("fedprox", 49.5), ("local", 47.0)):
        put(root, name, [value] * 3)
    return root


def text(answers, tmp_path, analysis: dict, t1: dict | None = None, curves: dict | None = None,
         remake: dict | None = None, curves_full: dict | None = None) -> str:
    for name, avgs in analysis.items():
        put(tmp_path / "a", name, avgs)
    for name, (avgs, curve) in (curves or {}).items():
        put(tmp_path / "c", name, avgs, curve)
    for name, (avgs, curve) in (curves_full or {}).items():
        put(tmp_path / "f", name, avgs, curve)
    for name, avgs in (remake or {}).items():  # seeds 1, 2: seed 0's folder is left empty
        put(tmp_path / "r", name, [0.0, *avgs])
        for d in (tmp_path / "r" / "flan" / name / "seed0").iterdir():
            d.unlink()
    table1(tmp_path / "t", **{"pflalign": (48.3, 48.0, 48.0), **(t1 or {})})
    return answers.answers(tmp_path / "a", tmp_path / "t", tmp_path / "c", tmp_path / "r", tmp_path / "f")


def section(text: str, number: int) -> str:
    return text.split(f"## {number}.")[1].split("\n## ")[0]


@pytest.mark.parametrize("low, high, verdict", [
    # pFLAlign 48 at lr 0.04 against FedAvg at 0.006; pFLAlign at 0.33 against FedAvg's 49 at 0.04
    ([47.0, 48.0, 46.5], [49.5, 50.0, 49.0], "**a step-size effect**"),  # +1.0/0/+1.5 and +0.5/+1/0
    ([49.0, 49.2, 48.9], [49.5, 50.0, 49.0], "**not a step-size effect**"),  # −1/−1.2/−0.9: below 0
    ([47.0, 48.5, 46.5], [49.5, 50.0, 49.0], "**a step-size effect**"),  # +1/−0.5/+1.5: the mean counts
    ([47.0, 50.0, 48.5], [49.5, 50.0, 49.0], "**undecided**"),  # +1/−2/−0.5: mean < 0, spans 0
    ([47.0, 48.0, 46.5], [48.5, 49.5, 48.0], "**undecided**"),  # −0.5/+0.5/−1: mean < 0, spans 0
    ([47.0, 48.0], [49.5, 50.0, 49.0], "waiting: 2 of 3 seeds of pflalign − fedavg@lr=0.006"),
])
def test_question_1_the_step_size_rule(answers, tmp_path, low, high, verdict):
    out = section(text(answers, tmp_path, {"fedavg@lr=0.006": low, "pflalign@lr=0.33": high}), 1)
    assert f"Verdict: {verdict}" in out


def test_question_1_reads_a_mean_of_exactly_zero_as_level(answers, tmp_path):
    out = section(text(answers, tmp_path, {"fedavg@lr=0.006": [48.0, 48.0, 48.0],
                                           "pflalign@lr=0.33": [49.0, 49.0, 49.0]}), 1)
    assert "Verdict: **a step-size effect**" in out and "| +0.00 ± 0.00 |" in out


@pytest.mark.parametrize("avgs, verdict", [
    ([46.0, 46.5, 45.5], "**helps**"),  # switched off: 2 below pFLAlign's 48 on every seed
    ([50.0, 49.5, 50.5], "**hurts**"),
    ([47.0, 49.0, 48.5], "no effect shown at 3 seeds"),
    ([46.0], "waiting: 1 of 3 seeds of pflalign-no-precond − pflalign"),
])
def test_question_2_the_component_rule(answers, tmp_path, avgs, verdict):
    out = section(text(answers, tmp_path, {"pflalign-no-precond": avgs}), 2)
    assert f"- the preconditioner: P ≡ 1: {verdict}" in out
    assert "- the correction: γ ≡ 0: waiting: 0 of 3 seeds" in out


def test_question_3_ranks_against_table_1s_other_rows(answers, tmp_path):
    """Table 1 without pFLAlign: FedDyn 51, FedProx 49.5, FedAvg 49, Local 47. pFLAlign at 0.33
    ranks 4th of 5 with w_kT (48) and 2nd with w^R + Delta_k (50); β 0.5 ties FedAvg both ways
    (a tie shares the better rank: 3rd) and so does not move; one seed only is shown, not judged."""
    out = section(text(answers, tmp_path, {
        "pflalign@lr=0.33": [48.0, 47.0, 49.0], "pflalign@lr=0.33,personalized=after_aggregation": [50.0] * 3,
        "pflalign@beta=0.5": [49.0] * 3, "pflalign@beta=0.5,personalized=after_aggregation": [49.004] * 3,
        "pflalign-no-precond": [40.0], "pflalign-no-precond@personalized=after_aggregation": [60.0],
    }), 3)
    assert "| pflalign@lr=0.33 | 0, 1, 2 | 48.00 | 4 of 5 | 50.00 | 2 of 5 |" in out
    assert "| pflalign@beta=0.5 | 0, 1, 2 | 49.00 | 3 of 5 | 49.00 | 3 of 5 |" in out
    assert "| pflalign-no-precond | 0 | 40.00 | 5 of 5 | 60.00 | 1 of 5 |" in out
    assert "Verdict: **the ranking changes** for pflalign@lr=0.33 (4 → 2) (2 setting(s) with 3 seeds)." in out


def test_question_3_table_1s_own_row_is_re_made_by_the_curves_and_remake_runs(answers, tmp_path):
    curves = {"pflalign": ([48.3], None), "pflalign@personalized=after_aggregation": ([49.6], None)}
    out = section(text(answers, tmp_path, {}, curves=curves), 3)
    assert "| pflalign (Table 1's, re-made) | 0 | 48.30 | 4 of 5 | 49.60 | 2 of 5 |" in out
    assert "Verdict: waiting" in out  # one seed of three
    out = section(text(answers, tmp_path / "all", {}, curves=curves, remake={
        "pflalign": [48.0, 48.0], "pflalign@personalized=after_aggregation": [49.6, 49.0]}), 3)
    assert "| pflalign (Table 1's, re-made) | 0, 1, 2 | 48.10 | 4 of 5 | 49.40 | 3 of 5 |" in out
    assert "Verdict: **the ranking changes** for pflalign (4 → 3) (1 setting(s) with 3 seeds)." in out


def test_question_3_says_when_a_re_made_run_is_not_table_1s(answers, tmp_path):
    out = section(text(answers, tmp_path, {}, t1={"pflalign": (48.2, 48.0, 48.0)},
                       curves={"pflalign": ([48.3], None), "pflalign@personalized=after_aggregation": ([49.6], None)},
                       remake={"pflalign": [48.0, 47.0], "pflalign@personalized=after_aggregation": [49.0, 49.0]}), 3)
    assert "(Table 1's, re-made; **its w_{k,T} Avg is not Table 1's on seed 0, 2**)" in out


def test_question_3_says_when_a_rescoring_is_not_of_the_run_beside_it(answers, tmp_path):
    """A rescoring keeps its source's global score; where it differs from the w_kT run's (seed 1 here: a
    committed run trained again on another CPU kind, say), the two are not one checkpoint scored twice."""
    put(tmp_path / "a", "pflalign@lr=0.33", [48.0] * 3, global_avgs=[45.0, 46.0, 47.0])
    put(tmp_path / "a", "pflalign@lr=0.33,personalized=after_aggregation", [50.0] * 3, global_avgs=[45.0, 46.1, 47.0])
    put(tmp_path / "a", "pflalign@beta=0.5", [49.0] * 3, global_avgs=[45.0, 46.0, 47.0])
    put(tmp_path / "a", "pflalign@beta=0.5,personalized=after_aggregation", [49.5] * 3, global_avgs=[45.0, 46.0, 47.0])
    table1(tmp_path / "t")
    out = section(answers.answers(*(tmp_path / d for d in "atcrf")), 3)
    assert "| pflalign@lr=0.33 (**rescored from another checkpoint than this w_{k,T} run on seed 1**) | 0, 1, 2 |" in out
    assert "| pflalign@beta=0.5 | 0, 1, 2 |" in out


@pytest.mark.parametrize("fedavg, pflalign, turn", [
    ({5: 30, 10: 36, 15: 40, 20: 44}, {5: 34, 10: 40, 15: 39, 20: 41}, 15),
    ({5: 30, 10: 42, 15: 38, 20: 44}, {5: 34, 10: 40, 15: 39, 20: 41}, 20),  # above at 10, not at 15: 20
    ({5: 30, 10: 36}, {5: 34, 10: 40}, None),
    ({5: 36, 10: 41}, {5: 34, 10: 40}, 5),
    ({5: 30, 10: 40}, {5: 34, 10: 40}, None),  # level is not above
])
def test_question_4_the_lead_turns_where_fedavg_stays_above(answers, fedavg, pflalign, turn):
    assert answers.lead_turn(fedavg, pflalign) == turn


def test_question_4_reads_the_round_eval_lines_of_the_curves_runs(answers, tmp_path):
    out = section(text(answers, tmp_path, {}, curves={
        "pflalign": ([48.0], {5: 34.0, 10: 40.0, 15: 39.0}), "fedavg": ([49.0], {5: 30.0, 10: 36.0, 15: 40.0}),
        "local": ([47.0], {5: 20.0, 10: 30.0, 15: 35.0})}), 4)
    assert "| 10 | 40.00 | 36.00 | 30.00 |" in out  # round_eval's 0-based round 9 is round 10
    assert "Verdict (20 test examples per client): **the lead turns at round 15**" in out
    # the subsample's last round beside the same runs' whole-split scores (48.0 against Table 1's FedAvg 49.0)
    assert "Round 15 on the subsample: pFLAlign − FedAvg -1.00; the same runs' final scores on the whole " \
           "test split (results.json): -1.00 (48.00 against 49.00)." in out
    assert "Verdict (whole test split, the answer): waiting: the curves-full runs" in out
    # Table 1's seed 0 is pFLAlign 48.3: the curves run of it scoring 48.0 is not what it claims to be
    assert "**Not Table 1's final Avg on seed 0, though its config**: pflalign (curves)." in out  # local: 47.0 both


def test_question_4s_answer_is_the_whole_test_splits_curve(answers, tmp_path):
    """As amended before the curves-full runs: the same rule on their round_eval lines is the answer,
    the subsample's verdict still shown."""
    out = section(text(answers, tmp_path, {}, curves={
        "pflalign": ([48.3], {5: 34.0, 10: 40.0}), "fedavg": ([49.0], {5: 30.0, 10: 36.0})}, curves_full={
        "pflalign": ([48.3], {5: 34.0, 10: 35.0}), "fedavg": ([49.0], {5: 33.0, 10: 36.0})}), 4)
    assert "Verdict (20 test examples per client): FedAvg is not above pFLAlign at the last scored round" in out
    assert "Verdict (whole test split, the answer): **the lead turns at round 10**" in out
    assert "Not Table 1's" not in out


@pytest.fixture(scope="module")
def committed(answers):
    """The committed runs as answers.py reads them (t1, runs, made, again, remade, full), and the short runs."""
    return answers.collected(*answers.ROOTS), answers.short_runs()


def test_the_committed_answers_are_the_scripts_output(answers, committed):
    """answers.md is regenerated from the committed runs: an edit by hand, or runs committed without
    rerunning the script, fails here."""
    assert (HERE / "answers.md").read_text() == answers.answers_text(*committed[0])


def readme_answer(answers, committed, runs=None) -> list[str]:
    t1, analysis, made, _, remade, full = committed[0]
    return answers.answer_lines(t1, runs or analysis, made, remade, full, committed[1])


def test_the_readmes_answer_is_the_scripts_output_from_the_committed_runs(answers, committed):
    """Issue 56: README.md opens with an answer of at most 40 lines whose every number answers.py computes
    from the committed runs; a number edited by hand, or runs committed without rerunning the script,
    fails here."""
    readme = (HERE / "README.md").read_text()
    lines = readme_answer(answers, committed)
    assert readme.index("## The answer") < readme.index(answers.ANSWER_BEGIN) < 200  # it opens the README
    assert answers.with_answer(readme, lines) == readme
    assert len(lines) <= 40


def test_the_readmes_answer_says_what_an_independent_reading_of_the_runs_found(answers, committed):
    """The figures issue 56 quotes from its own reading of the committed runs, found by the script."""
    text = " ".join(" ".join(readme_answer(answers, committed)).split())  # the wrapped lines as one
    for figure in ["+2.00 ± 0.89, higher on every seed", "structure_to_text −3.26 ± 1.40", "coreference +0.78",
                   "entailment +6.33", "paraphrase −8.67", "lr 0.0037", "−1.20 ± 1.23 at 0.09×",
                   "−0.40 ± 1.11 at 0.61×", "+0.79 ± 1.70 at 0.61×", "FedAvg at 0.006 took 1.6× pFLAlign's step",
                   "131 of the 200 paraphrase references are 'no'", "scores 65.50", "p = 0.050",
                   "lower on 3 of 3 seeds", "at 7 of 10 rounds", "56 test examples", "at round 45",
                   "the ranking changes for 2 of 6 settings", "as close as 0.03 points", "undecided"]:
        assert figure in text, figure


def test_the_readmes_answer_moves_with_the_runs(answers, committed):
    """A changed run changes the answer, so the README check above fails on it: pFLAlign at lr 0.33
    scoring 3 points more on seed 0 lifts its paired gain by 1.00 on the mean."""
    import dataclasses

    runs = dict(committed[0][1])
    seed0 = runs["pflalign@lr=0.33"][0]
    results = {**seed0.results, "avg_rouge_l_personalized": seed0.results["avg_rouge_l_personalized"] + 3}
    runs["pflalign@lr=0.33"] = {**runs["pflalign@lr=0.33"], 0: dataclasses.replace(seed0, results=results)}
    text = " ".join(" ".join(readme_answer(answers, committed, runs)).split())
    assert "lr 0.33 instead of 0.04: +3.00 ±" in text and "+2.00 ± 0.89" not in text
    readme = (HERE / "README.md").read_text()
    assert answers.with_answer(readme, readme_answer(answers, committed, runs)) != readme


def test_per_client_differences_are_paired_by_seed_per_task(answers, tmp_path):
    put(tmp_path / "a", "pflalign", [48.0, 47.0, 49.0])
    put(tmp_path / "a", "fedavg", [49.0, 49.5, 48.0])
    runs = answers.by_name(answers.find_runs(tmp_path / "a")[0])
    d = answers.per_client(runs["pflalign"], runs["fedavg"])["t"]
    assert d.seeds == [0, 1, 2] and d.diffs == [-1.0, -2.5, 1.0]


def test_the_majority_label_and_its_score(answers, tmp_path):
    """Three of four references 'no': answering 'no' to all scores 75; the model's top answer and its share."""
    put(tmp_path / "a", "fedavg", [50.0])
    d = tmp_path / "a" / "flan" / "fedavg" / "seed0"
    rows = [("no", "No"), ("no", "no"), ("no", "yes"), ("yes", "no")]
    (d / "predictions.jsonl").write_text("".join(json.dumps(
        {"client": 0, "task": "t", "reference": ref, "personalized": out}) + "\n" for ref, out in rows))
    run = answers.by_name(answers.find_runs(tmp_path / "a")[0])["fedavg"]
    assert answers.majority(run[0], "t") == ("no", 3, 4, pytest.approx(75.0))
    assert answers.top_answers(run, "t") == [("no", 0.75)]


def test_p_is_the_paired_t_tests(answers):
    from scipy import stats

    d = answers.Difference("a", "b", [0, 1, 2], [1.62, 2.06, 3.45])
    assert answers.p_two_sided(d) == pytest.approx(stats.ttest_1samp(d.diffs, 0).pvalue)


def test_the_p_cap_is_the_methods(answers):
    """As tests/test_pflalign.py measures it with a 3-element gradient."""
    assert [round(answers.p_cap(b), 4) for b in (0.5, 0.8, 0.9)] == [0.8543, 0.2874, 0.0895]


def test_a_rank_move_and_how_close_it_passes_a_row(answers):
    moved = answers.Ranking("x", [0, 1, 2], 50.03, 50.34, [50.31, 50.36, 49.0], "", None)
    assert moved.ranks == (3, 2) and answers.crossing_margin(moved) == pytest.approx(0.03)
    still = answers.Ranking("y", [0, 1, 2], 47.31, 47.44, [50.31, 49.0], "", None)
    assert still.ranks == (3, 3) and answers.crossing_margin(still) is None


def test_the_answer_replaces_only_its_block(answers):
    readme = f"# T\n\n{answers.ANSWER_BEGIN}\nold\n{answers.ANSWER_END}\n\nrest\n"
    assert answers.with_answer(readme, ["a", "b"]) == f"# T\n\n{answers.ANSWER_BEGIN}\na\nb\n{answers.ANSWER_END}\n\nrest\n"


def test_long_run_advice_is_the_best_complete_setting(answers, tmp_path):
    """Table 1's β 0.8 at 0.04 has 48.10 (48.3, 48, 48); lr 0.33 49.00; β 0.5 49.004, shown 49.00:
    a tie, so the first listed (lr 0.33) is advised; with one setting short of seeds, nothing is."""
    out = text(answers, tmp_path, {"pflalign@lr=0.33": [49.0] * 3, "pflalign@beta=0.5": [49.004] * 3,
                                   "fedavg@lr=0.16": [50.0, 50.5, 49.5]}).split("## Long runs")[1]
    assert "| β 0.8, lr 0.33 (4a) | 0, 1, 2 | 49.00 ± 0.00 | +0.00 ± 0.00 | -1.00 ± 1.24 |" in out
    assert "Advised setting for 50 rounds: **β 0.8, lr 0.33 (4a)** (highest mean Avg, 49.00)." in out
    out = text(answers, tmp_path / "short", {"pflalign@lr=0.33": [49.0] * 3}).split("## Long runs")[1]
    assert "Advised setting: waiting (2 of 3 settings have 3 seeds)." in out


def test_the_figure_draws_every_paired_difference_the_answers_rest_on(answers, tmp_path):
    """answers.png's rows: Table 1's pFLAlign − FedAvg first, then the questions' comparisons in order,
    planned rows with no seed yet included (drawn as "waiting"); Table 1's re-made row pairs the curves
    run's seed 0 with the remake runs' seeds 1-2."""
    for name, avgs in {"fedavg@lr=0.006": [48.0, 48.5, 47.0], "pflalign-no-precond": [50.0],
                       "pflalign@lr=0.33": [49.0] * 3, "pflalign@lr=0.33,personalized=after_aggregation": [50.0] * 3,
                       }.items():
        put(tmp_path / "a", name, avgs)
    put(tmp_path / "c", "pflalign", [48.3])
    put(tmp_path / "c", "pflalign@personalized=after_aggregation", [49.3])
    put(tmp_path / "r", "pflalign@personalized=after_aggregation", [0.0, 48.5, 48.0])
    put(tmp_path / "r", "pflalign", [0.0, 48.0, 48.0])
    for p in (*(tmp_path / "r" / "flan").glob("*/seed0/*"),):
        p.unlink()
    table1(tmp_path / "t", pflalign=(48.3, 48.0, 48.0))
    _, runs, _, _, remade, _ = answers.collected(tmp_path / "a", tmp_path / "t", tmp_path / "c", tmp_path / "r",
                                                 tmp_path / "f")
    rows = {(group, label): (d.seeds, [round(x, 2) for x in d.diffs])
            for group, label, d in answers.differences(runs, remade)}
    assert list(rows)[:4] == [("Table 1 (lr 0.04)", "pFLAlign − FedAvg"), ("1", "pFLAlign lr 0.04 − FedAvg lr 0.006"),
                              ("1", "pFLAlign lr 0.33 − FedAvg lr 0.04"), ("2", "pflalign-no-precond − pFLAlign")]
    assert rows["Table 1 (lr 0.04)", "pFLAlign − FedAvg"] == ([0, 1, 2], [-0.7, -1.0, -1.0])
    assert rows["1", "pFLAlign lr 0.04 − FedAvg lr 0.006"] == ([0, 1, 2], [0.3, -0.5, 1.0])
    assert rows["2", "pflalign-no-precond − pFLAlign"] == ([0], [1.7])
    assert rows["2", "pflalign-no-correction − pFLAlign"] == ([], [])
    assert rows["2", "pflalign-no-precond − FedAvg (lr 0.04)"] == ([0], [1.0])  # the part that is not a step size
    assert rows["3", "w^R + Δ_k − w_kT, Table 1 re-made"] == ([0, 1, 2], [1.0, 0.5, 0.0])
    assert rows["3", "w^R + Δ_k − w_kT, pflalign@lr=0.33"] == ([0, 1, 2], [1.0, 1.0, 1.0])
    assert rows["3", "w^R + Δ_k − w_kT, pflalign@beta=0.5"] == ([], [])  # planned, not run yet
    assert ("4b", "pFLAlign β 0.5 − Local lr 0.16") in rows
    answers.figure(answers.differences(runs, remade), tmp_path / "answers.png")
    assert (tmp_path / "answers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_baselines_own_lrs_are_the_sweep_files(answers, tmp_path):
    """OWN_LR (the 4b rows the answers compare) names each baseline at the lr its full runs are kept
    at: validated.toml's, replaced by validated-next.toml's for a method found there (its validated
    lr's seed 0 diverged). A lr written into either file without answers.py following fails here."""
    from pflalign.sweep import plan_sweep

    def keys(file: str) -> dict:
        if not (HERE / file).exists():
            return {}
        return {r.cfg.method: r.key.split("/")[1] for r in plan_sweep(str(HERE / file), tmp_path / file,
                                                                      data_dir=str(tmp_path), seeds=[0])}

    if not (HERE / "validated.toml").exists():
        pytest.skip("validated.toml is written once 4b's validation grid is in")
    kept = {**keys("validated.toml"), **keys("validated-next.toml")}
    kept.pop("pflalign")  # pFLAlign's own 4b rows are a β (OWN_LR_PFLALIGN), not an lr
    assert {name for name, _ in answers.OWN_LR} == set(kept.values())
    for name, label in answers.OWN_LR:  # the label says the same lr
        assert label.endswith("lr " + name.split("lr=")[1])
