""" "Did you mean …?": the closest valid names to what a user typed, in one place.

Every error about an unknown name (a format, a layer, a module, a YAML key) suggests from
here, so the cut-off and the phrasing are the same everywhere."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

CUTOFF = 0.6  # difflib's default similarity ratio for a suggestion


def close_matches(
    typed: str | Iterable[str], valid: Sequence[str], *, n: int = 3, cutoff: float = CUTOFF
) -> list[str]:
    """Valid names closest to ``typed`` (one name or several), best first, without repeats."""
    words = [typed] if isinstance(typed, str) else list(typed)
    out: list[str] = []
    for word in words:
        for match in difflib.get_close_matches(str(word), valid, n=n, cutoff=cutoff):
            if match not in out:
                out.append(match)
    return out


def did_you_mean(
    typed: str | Iterable[str],
    valid: Sequence[str],
    *,
    n: int = 3,
    cutoff: float = CUTOFF,
    quote: bool = False,
) -> str:
    """``"Did you mean a, b?"`` for the closest valid names, or ``""`` when none is close."""
    close = close_matches(typed, valid, n=n, cutoff=cutoff)
    if not close:
        return ""
    return f"Did you mean {', '.join(repr(c) if quote else c for c in close)}?"
