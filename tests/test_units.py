"""Size strings as users type them, and the bytes they mean."""

import pytest

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
