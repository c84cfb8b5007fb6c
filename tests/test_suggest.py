"""memplan.suggest: the one home of "did you mean" (#24)."""

from hypothesis import given
from hypothesis import strategies as st

from memplan.suggest import close_matches, did_you_mean


def test_suggests_the_close_names_best_first_without_repeats():
    valid = ["blocks.0", "blocks.1", "head", "embed"]
    assert close_matches("embd", valid, n=1) == ["embed"]
    assert close_matches(["hed", "haed"], valid) == ["head"]  # both suggest head: once
    assert did_you_mean("hed", valid) == "Did you mean head?"
    assert did_you_mean("hed", valid, quote=True) == "Did you mean 'head'?"
    assert did_you_mean("zzzzzz", valid) == ""


@given(st.text(max_size=12), st.lists(st.text(max_size=12), max_size=8))
def test_suggestions_are_always_valid_names(typed, valid):
    found = close_matches(typed, valid)
    assert set(found) <= set(valid) and len(found) == len(set(found))
    assert (did_you_mean(typed, valid) == "") == (found == [])
