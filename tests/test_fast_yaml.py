"""memplan.files.fast_yaml writes what yaml.safe_load reads back, for any plain data, and a
profile's YAML the same as PyYAML's (as data)."""

import contextlib
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import uniform_chain

from memplan.files import fast_yaml
from memplan.files.schema import dump_yaml, safe_load, to_data
from memplan.profile import profile_from_data, profile_to_yaml

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text()
    | st.sampled_from(["yes", "No", "null", "~", "1e5", "0x1F", "-", "a: b", "#x", "", " a"])
)
DATA = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(DATA)
def test_any_plain_data_reads_back_equal(data):
    assert yaml.safe_load(fast_yaml.dump(data)) == data


def test_special_floats_and_exponents():
    text = fast_yaml.dump({"x": [1e16, -1e-7, math.inf, -math.inf, 0.5, 2.0]})
    assert text == "x: [1.0e+16, -1.0e-07, .inf, -.inf, 0.5, 2.0]\n"
    assert math.isnan(yaml.safe_load(fast_yaml.dump(math.nan)))


def test_a_profile_reads_back_as_pyyaml_writes_it():
    profile = uniform_chain(5).profile()
    assert yaml.safe_load(profile_to_yaml(profile)) == yaml.safe_load(dump_yaml(profile))
    assert profile_from_data(yaml.safe_load(profile_to_yaml(profile))) == profile
    assert to_data(profile) == yaml.safe_load(profile_to_yaml(profile))


@settings(max_examples=300, deadline=None)
@given(DATA)
def test_the_fast_reader_reads_what_pyyaml_reads(data):
    text = fast_yaml.dump(data)
    try:
        fast = fast_yaml.load(text)
    except fast_yaml.NotFast:
        return
    assert fast == yaml.safe_load(text)


@pytest.mark.parametrize(
    "text",
    [
        "a: 1e5\n",  # a string to YAML 1.1, a float to JSON
        "a: [1e5]\n",
        "a: 01\n",
        "a: yes\n",
        'a: ["\\ud83d\\ude00"]\n',  # a pair JSON joins and YAML does not
        "a: 1 # note\n",
        "a:\n- 1\n",  # PyYAML's own layout
        "--- 1\n",
        "a: 1\na: 2\n",
        'a: {"x": 1, "x": 2}\n',  # JSON keeps the last; memplan's loader refuses it
    ],
)
def test_text_of_another_layout_is_left_to_pyyaml(text):
    with pytest.raises(fast_yaml.NotFast):
        fast_yaml.load(text)
    with contextlib.suppress(yaml.YAMLError):  # PyYAML reads it, or says why not
        safe_load(text)


def test_a_profile_is_read_fast_to_the_same_data():
    text = profile_to_yaml(uniform_chain(5).profile())
    assert fast_yaml.load(text) == yaml.safe_load(text)
