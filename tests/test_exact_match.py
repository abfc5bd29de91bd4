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
