"""Issue 59's measure, kept: a run's config, traced from `run/engine.py:run` (tests/cfg_trace.py),
makes at most 35 stops and enters no module more than twice, on the synthetic tasks and on a Dolly
file through the paper's preset (the path every paper federation takes)."""

from __future__ import annotations

import pytest

from cfg_trace import measure, measured


@pytest.mark.parametrize("data", ["synthetic", "dolly"])
def test_the_config_travels_a_short_way_and_enters_each_module_at_most_twice(data):
    stops, counts = measured(data)
    assert ("pflalign.run.engine", "run") in stops  # the trace starts where a run starts
    assert counts["stops"] <= 35, counts
    assert counts["most_entries"] <= 2, counts


def test_the_measure_counts_a_return_to_a_module_as_an_entry():
    # a → b → a: a is entered twice, one re-entry; a function reached again is one stop
    stops = [("a", "f"), ("b", "g"), ("a", "h")]
    assert measure(stops) == {"stops": 3, "modules": 2, "re_entries": 1, "most_entries": 2,
                              "entries": {"a": 2, "b": 1}}
