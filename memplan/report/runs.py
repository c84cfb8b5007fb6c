"""Runs of alike layers, for whatever shows one row, bar or block per layer.

A model of 10,000 identical blocks is shown as ``blocks.2–9998 × 9,997`` with one row of
numbers, not 10,000 rows: the render, the report's table, chart and timeline all group
consecutive layers whose shown values are equal (``runs``) and name a group with
``run_label``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MIN_RUN = 3
"""Fewer alike neighbours are shown one by one."""


@dataclass(frozen=True, slots=True)
class Run:
    """Items ``start .. stop-1``, all alike."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


def runs(keys: Sequence[Hashable], min_run: int = MIN_RUN) -> list[Run]:
    """Consecutive items with equal keys, as runs; shorter than ``min_run`` items are
    runs of one. Together the runs cover every item once, in order."""
    out: list[Run] = []
    i = 0
    while i < len(keys):
        j = i + 1
        while j < len(keys) and keys[j] == keys[i]:
            j += 1
        if j - i >= min_run:
            out.append(Run(i, j))
        else:
            out.extend(Run(k, k + 1) for k in range(i, j))
        i = j
    return out


def run_label(names: Sequence[str], run: Run) -> str:
    """``blocks.3–9998 × 9,996`` for numbered siblings, ``a … b × n`` otherwise; a run of
    one is its name."""
    first, last = names[run.start], names[run.stop - 1]
    if run.count == 1:
        return first
    head, _, a = first.rpartition(".")
    tail_head, _, b = last.rpartition(".")
    if head == tail_head and a.isdigit() and b.isdigit():
        prefix = f"{head}." if head else ""
        return f"{prefix}{a}–{b} × {run.count:,}"
    return f"{first} … {last} × {run.count:,}"
