"""Exact match: normalised by case, punctuation and whitespace, ×100."""

from pflalign.evaluate import add_exact_match, exact_match, normalize_answer


def test_normalisation_ignores_case_punctuation_and_whitespace():
    assert normalize_answer("  Yes. ") == normalize_answer("yes") == "yes"
    assert normalize_answer("Not\tentailment!") == "not entailment"
    assert normalize_answer("«Oui», non…") == "oui non"
    assert normalize_answer("it's") == "its"
    assert normalize_answer("yes") != normalize_answer("no")


def test_exact_match_is_the_share_of_equal_normalised_answers():
    assert exact_match(["Yes.", "no", "maybe"], ["yes", "No!", "yes"]) == 100.0 * 2 / 3
    assert exact_match([], []) == 0.0
    assert exact_match(["option a"], ["option b"]) == 0.0


def test_add_exact_match_per_client_and_average():
    results = {"clients": [{"task": "a"}, {"task": "b"}]}
    preds = [{"task": "a", "reference": "x", "personalized": "X.", "global": "y", "base": None},
             {"task": "a", "reference": "z", "personalized": "w", "global": "z", "base": None},
             {"task": "b", "reference": "ok", "personalized": "ok", "global": "ok", "base": None}]
    add_exact_match(results, preds)
    a, b = results["clients"]
    assert (a["exact_match_personalized"], a["exact_match_global"], a["exact_match_base"]) == (50.0, 50.0, None)
    assert (b["exact_match_personalized"], b["exact_match_global"]) == (100.0, 100.0)
    assert results["avg_exact_match_personalized"] == 75.0 and results["avg_exact_match_base"] is None


def test_report_computes_exact_match_of_older_runs_from_their_predictions(tmp_path):
    import json

    from pflalign.analysis.report import Run, summarize, with_exact_match

    preds = [{"task": "a", "reference": "Yes", "personalized": "yes.", "global": "no", "base": None},
             {"task": "a", "reference": "No", "personalized": "maybe", "global": "no", "base": None}]
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    results = {"clients": [{"task": "a", "rouge_l_personalized": 10.0}], "avg_rouge_l_personalized": 10.0}
    run = with_exact_match(Run(tmp_path, "d", "fedavg", 0, results, {}, []))
    assert run.results["clients"][0]["exact_match_personalized"] == 50.0
    tasks, rows = summarize([run], "exact_match")
    assert tasks == ["a"] and rows[0].cells == {"a": 50.0} and rows[0].avg == 50.0
    assert summarize([run])[1][0].avg == 10.0
