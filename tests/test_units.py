"""Size strings as users type them, and the bytes they mean."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memplan.errors import BadInputError
from memplan.units import GiB, MiB, format_bytes, format_seconds, parse_budget, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("512 mib", 512 * 1024**2),
        ("80GB", 80 * 10**9),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("1073741824", 1073741824),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "24 parsecs", "-3GiB", "1e9"])
def test_parse_size_rejects_with_example(text):
    with pytest.raises(BadInputError, match=r"e\.g\. 24GiB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1PiB", "1000000000PiB", "2EB", "3p", "1 ZiB"])
def test_a_unit_past_tib_is_said_to_be_larger_than_any_device(text):
    # it was "is not a size", as if PiB were no unit at all (memplan.yaml and --budget alike)
    with pytest.raises(BadInputError) as info:
        parse_size(text, what="budget")
    assert info.value.message == (
        f"budget {text!r} is larger than any device's memory: memplan reads sizes in B, KiB, "
        f"MiB, GiB and TiB (and KB to TB), not {text.lstrip('0123456789 ')}."
    )
    with pytest.raises(BadInputError, match="is not a size"):
        parse_size("1XiB")


@given(n=st.integers(0, 2**62), unit=st.sampled_from(["", "B", "KiB", "MB", "GiB", "TB"]))
def test_parse_size_is_exact_up_to_two_to_the_62(n, unit):
    """Sizes were read through a float: 2**53 + 1 bytes came back as 2**53, and any size
    over 2**62 passed, to be refused by memplan's own read-back of its plan (exit 3)."""
    scale = {"": 1, "B": 1, "KiB": 1024, "MB": 10**6, "GiB": 1024**3, "TB": 10**12}[unit]
    if n * scale <= 2**62:
        assert parse_size(f"{n}{unit}") == n * scale
    else:
        with pytest.raises(BadInputError, match=r"absurdly large \(over 2\*\*62 bytes\)"):
            parse_size(f"{n}{unit}")


def test_parse_size_exact_cases():
    assert parse_size("9007199254740993") == 2**53 + 1  # float: 2**53
    assert parse_size("1.1GB") == 1_100_000_000
    assert parse_size("0.5B") == 0  # whole bytes, the fraction dropped (as before)
    with pytest.raises(BadInputError, match="absurdly large"):
        parse_budget(str(10**30))
    with pytest.raises(BadInputError, match="absurdly large"):
        parse_size(2**62 + 1)


def test_budget_percent_of_capacity():
    assert parse_budget("80%", capacity_bytes=80 * GiB) == 64 * GiB
    assert parse_budget("100%", capacity_bytes=1000) == 1000


def test_budget_percent_needs_a_device():
    with pytest.raises(BadInputError, match="--device-profile"):
        parse_budget("80%")


def test_budget_percent_out_of_range():
    with pytest.raises(BadInputError, match=r"\(0, 100\]"):
        parse_budget("120%", capacity_bytes=GiB)


def test_budget_auto_uses_free_memory():
    assert parse_budget("auto", free_bytes=7 * GiB) == 7 * GiB
    with pytest.raises(BadInputError, match=r"none is visible"):
        parse_budget("auto")


def test_budget_zero_rejected():
    with pytest.raises(BadInputError, match="larger than zero"):
        parse_budget("0")


def test_format_bytes():
    assert format_bytes(24 * GiB) == "24.0 GiB"
    assert format_bytes(512 * MiB) == "512.0 MiB"
    assert format_bytes(-3 * GiB - 300 * MiB) == "-3.3 GiB"
    assert format_bytes(100) == "100 B"


def test_format_seconds():
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(75) == "75.00 s"
    assert format_seconds(2e-6) == "2 µs"
