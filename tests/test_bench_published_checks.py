"""bench/published_checks.py: the 405B rows with the same per-rank shapes (Table 5's 1F1B
run and Table 6's cp 1 run, torchtitan benchmarks/llama3_h100_202412_torchtitan.md), the
window of predictions within 10% of both, and the op-mix rows' factories and lines."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.published import CP_ROWS, ROWS, Published
from bench.published_checks import (
    SAME_SHAPES,
    op_mix_line,
    same_shapes,
    same_shapes_line,
    verdict_sentence,
    with_titan_ops,
    within_both,
)


def _rows(key):
    return [r for r in ROWS + CP_ROWS if (r.model, r.table, r.schedule) == key]


def test_the_same_shape_rows_are_the_published_ones():
    (table5,), (table6,) = (_rows(key) for key in SAME_SHAPES)
    # Table 5: local batch 32 in pp = 8 micro-batches of 4 at 8192; Table 6: 8 of 1 at 32768
    assert (table5.local_batch, table5.micro, table5.seq) == (32, 4, 8192)
    assert (table6.local_batch, table6.micro, table6.seq, table6.cp) == (8, 1, 32768, 1)
    assert (table5.memory_gib, table6.memory_gib) == (82.5, 75.3)
    assert same_shapes(table5, table6) and same_shapes(table6, table5)


def test_other_rows_do_not_have_the_same_shapes():
    table5 = _rows(SAME_SHAPES[0])[0]
    interleaved = next(r for r in ROWS if r.table == "Table 5" and r.schedule != "1f1b")
    cp2 = next(r for r in CP_ROWS if r.model == "405B" and r.cp == 2)
    assert not same_shapes(table5, interleaved)  # another schedule
    assert not same_shapes(table5, cp2)  # 65,536 tokens a micro-batch, dp 4
    # twice the micro-batches of half the tokens: the same tokens a step, not the same shapes
    halved = dataclasses.replace(table5, local_batch=32, micro=2)
    assert not same_shapes(table5, halved)


def test_the_window_within_ten_percent_of_both():
    low, high = within_both([82.5, 75.3])
    assert low == pytest.approx(74.25) and high == pytest.approx(82.83)
    low, high = within_both([100.0, 80.0])  # 90 > 88: no prediction is within 10% of both
    assert low > high


def test_the_same_shapes_paragraph_places_memplan_against_the_window():
    rows = [_rows(key)[0] for key in SAME_SHAPES]
    text = same_shapes_line([(rows[0], 72.1), (rows[1], 72.1)])
    assert "82.5 GiB and" in text and "75.3 GiB (7.2 GiB apart)" in text
    assert "74.2–82.8 GiB" in text and "2.2 GiB below it" in text
    assert "inside it" in same_shapes_line([(rows[0], 76.0), (rows[1], 76.0)])
    interleaved = next(r for r in ROWS if r.table == "Table 5" and r.schedule != "1f1b")
    with pytest.raises(ValueError, match="same shapes"):
        same_shapes_line([(rows[0], 72.1), (interleaved, 75.3)])


def test_op_mix_rows_and_line():
    row = next(r for r in ROWS if r.model == "8B" and r.techniques == "eager")
    titan = with_titan_ops(row)
    assert titan.factory == "build_8b_torchtitan_ops" and titan.tp == row.tp
    assert with_titan_ops(dataclasses.replace(row, factory="build_70b")) is None

    def plan(seconds):
        return SimpleNamespace(predicted=SimpleNamespace(step_seconds=seconds))

    step = row.step_seconds  # 2 × 8192 tokens / 5,762 TPS
    assert step == pytest.approx(2.843, abs=5e-4)
    line = op_mix_line(row, (plan(step * 0.85), 78.0), (plan(step * 0.84), 82.4 * 0.9))
    assert "(0.85) | 78.0 (0.95)" in line and "(0.84) | 74.2 (0.90)" in line
    assert isinstance(row, Published)


def test_one_prediction_for_both_gives_one_verdict():
    # 82.5 + context + NCCL = 83.4 GiB does not fit 79.6; 75.3 + the same = 76.2 does
    capacity = 85_520_809_984 / 2**30
    text = verdict_sentence([("Table 5", 83.4), ("Table 6, seq 32,768", 76.2)], capacity)
    assert "(79.6 GiB) Table 6, seq 32,768 fits and Table 5 does not" in text
    assert "one of the two is wrong whichever it is" in text
    assert verdict_sentence([("Table 5", 83.4), ("Table 6", 80.0)], capacity) == ""
    rows = [_rows(key)[0] for key in SAME_SHAPES]
    assert same_shapes_line([(rows[0], 72.1), (rows[1], 72.1)], text).endswith(text)
