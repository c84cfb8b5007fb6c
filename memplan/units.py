"""Byte sizes as people write them (``24GiB``, ``512MiB``, ``80%``, ``auto``) and back."""

from __future__ import annotations

import re
from decimal import Decimal

from memplan.errors import BadInputError
from memplan.files.schema import LARGEST_INT

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# Binary units are what GPU vendors' "80GB" actually means in nvidia-smi; decimal units are
# accepted too, because people type them, and mean exactly 10**n.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": KiB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": MiB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": GiB,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse an absolute size (``24GiB``, ``512MiB``, ``1.5GB``, ``1073741824``) to bytes:
    exactly (decimal arithmetic, whole bytes, fractions dropped), at most 2**62, the largest
    integer a plan or profile holds."""
    if isinstance(text, int):
        if text < 0:
            raise BadInputError(f"{what} must not be negative, got {text}.")
        size = text
    else:
        size = _size_of_text(text, what)
    if size > LARGEST_INT:
        raise BadInputError(
            f"{what} {text!r} is absurdly large (over 2**62 bytes).",
            hint="Check the number and its unit, e.g. 80GiB.",
        )
    return size


_PAST_TIB = re.compile(r"^[pezy](i?b)?$")
"""Units past TiB (``PiB``, ``EB``): a size, but more than any device holds."""


def _size_of_text(text: str, what: str) -> int:
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if unit is not None and _PAST_TIB.match(unit):
        raise BadInputError(
            f"{what} {text!r} is larger than any device's memory: memplan reads sizes in B, "
            f"KiB, MiB, GiB and TiB (and KB to TB), not {match.group(2)}.",
            hint="Check the number and its unit, e.g. 80GiB.",
        )
    if not match or unit not in _UNITS:
        raise BadInputError(
            f"{what} {text!r} is not a size.",
            hint="Write it as bytes or with a unit, e.g. 24GiB, 512MiB, 80GB, 1073741824.",
        )
    return int(Decimal(match.group(1)) * _UNITS[unit])


def _spec_option(what: str) -> str:
    """How the one asking names a device spec: the flag on the command line, the
    ``device_profile`` argument or key from Python or memplan.yaml (which said to add a flag
    they cannot pass)."""
    return "--device-profile" if what.startswith("--") else "device_profile"


def parse_budget(
    text: str | int,
    *,
    capacity_bytes: int | None = None,
    free_bytes: int | None = None,
    what: str = "--budget",
) -> int:
    """Parse a budget: a size, ``N%`` of ``capacity_bytes``, or ``auto`` (= ``free_bytes``).

    The caller supplies capacity and free memory (from a device profile, NVML or
    ``torch.cuda.mem_get_info``); this module only does the arithmetic."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        if free_bytes is None:
            raise BadInputError(
                f"{what} auto needs the free memory of a GPU, and none is visible.",
                hint=f"Give an explicit size (e.g. 24GiB) or a percentage with {_spec_option(what)}.",
            )
        return int(free_bytes)
    if isinstance(text, str) and (match := _PERCENT_RE.match(text)):
        percent = float(match.group(1))
        if not 0 < percent <= 100:
            raise BadInputError(f"{what} {text!r}: a percentage must be in (0, 100].")
        if capacity_bytes is None:
            raise BadInputError(
                f"{what} {text!r} is a percentage of device memory, but no device is known.",
                hint=f"Add {_spec_option(what)} NAME (see profiles/devices/) or give a size "
                "like 24GiB.",
            )
        return int(capacity_bytes * percent / 100)
    size = parse_size(text, what=what)
    if size == 0:
        raise BadInputError(f"{what} must be larger than zero.")
    if isinstance(text, str) and size < MiB and (m := _SIZE_RE.match(text)) and not m[2]:
        # a number with no unit is bytes: `--budget 24` no-fit with no word of why
        import warnings

        said = f"memplan: {what} {m[1]} is {size} bytes: did you mean {m[1]}GiB?"
        warnings.warn(said, stacklevel=2)
    return size


def format_bytes(num_bytes: float, *, precision: int = 1) -> str:
    """Human-readable binary size: ``25769803776`` -> ``24.0 GiB``."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= scale:
            return f"{sign}{value / scale:.{precision}f} {unit}"
    return f"{sign}{value:.0f} B"


def format_seconds(seconds: float) -> str:
    """``0.0123`` -> ``12.3 ms``; ``75`` -> ``75.0 s``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"
