"""The warnings' rules, one property each."""

from __future__ import annotations

from analysis import fitwarn


def test_a_value_at_a_bound_is_named_with_the_bound():
    assert fitwarn.at_bounds({"gamma": 1.0}, {"gamma": (0.01, 1.0)}) == [
        "gamma = 1 is at its upper bound 1: the optimum may lie beyond it"]
    assert fitwarn.at_bounds({"gamma": 0.5}, {"gamma": (0.01, 1.0)}) == []


def test_eval_well_above_train_is_memorisation_and_close_is_not():
    assert fitwarn.memorisation("d48", 1.689, 1.832) and "memorised" in fitwarn.memorisation("d48", 1.689, 1.832)[0]
    assert fitwarn.memorisation("d24", 2.54, 2.57) == []


def test_refits_spanning_ten_times_disagree_wildly():
    w = fitwarn.bootstrap_disagreement({"C": [0.001, 0.05], "A": [1.0, 1.2]}, 30, 0, positive=["C", "A"])
    assert len(w) == 1 and w[0].startswith("bootstrap refits disagree wildly on C")
    assert fitwarn.bootstrap_disagreement({}, 10, 5)[0].startswith("5 of 15 bootstrap refits failed")
