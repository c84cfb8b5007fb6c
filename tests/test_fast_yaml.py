"""memplan.fast_yaml writes what yaml.safe_load reads back, for any plain data, and a
profile's YAML the same as PyYAML's (as data)."""

import math

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import uniform_chain

from memplan import fast_yaml
from memplan.profile import profile_from_data, profile_to_yaml
from memplan.schema import dump_yaml, to_data

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
    text = fast_yaml.dump([1e16, -1e-7, math.inf, -math.inf, 0.5, 2.0])
    assert text == "[1.0e+16, -1.0e-07, .inf, -.inf, 0.5, 2.0]\n"
    assert math.isnan(yaml.safe_load(fast_yaml.dump(math.nan)))


def test_a_profile_reads_back_as_pyyaml_writes_it():
    profile = uniform_chain(5).profile()
    assert yaml.safe_load(profile_to_yaml(profile)) == yaml.safe_load(dump_yaml(profile))
    assert profile_from_data(yaml.safe_load(profile_to_yaml(profile))) == profile
    assert to_data(profile) == yaml.safe_load(profile_to_yaml(profile))
