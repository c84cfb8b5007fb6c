"""Thousands of alike layers: runs are grouped (memplan.report.runs) in the profile table and
the report's timeline, chart and table, and the page stays under MAX_HTML_BYTES."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from profiles_factory import uniform_chain

from memplan import memory
from memplan.report import MAX_HTML_BYTES, predicted_timeline, render_report
from memplan.report.data import coarser, profile_report
from memplan.report.runs import Run, run_label, runs


@given(st.lists(st.integers(0, 2), max_size=30))
def test_runs_cover_every_item_once_and_group_only_equal_neighbours(keys):
    found = runs(keys)
    assert [i for r in found for i in range(r.start, r.stop)] == list(range(len(keys)))
    for r in found:
        assert len({keys[i] for i in range(r.start, r.stop)}) == 1
        assert r.count == 1 or r.count >= 3


def test_run_labels():
    names = [f"blocks.{i}" for i in range(10_000)]
    assert run_label(names, Run(2, 9999)) == "blocks.2–9998 × 9,997"
    assert run_label(["a", "b", "c"], Run(0, 3)) == "a … c × 3"
    assert run_label(names, Run(5, 6)) == "blocks.5"


def test_a_thousand_identical_layers_draw_as_a_few_bars_with_the_same_peak():
    profile = uniform_chain(1000).profile()
    line = predicted_timeline(profile, 4, frozenset(), 2)
    peak = memory.step_peak(profile, 4, frozenset(), 2)
    assert line.peak_bytes == peak.peak_bytes
    every = sum(len(s) for s in profile.timeline.values()) + 1
    assert len(line.bars) < 40 < every
    # h.0 sees the embedding's output, the others a block's: h.1 to h.999 are one run
    assert sum(bar.layer == "h.1–999 × 999" for bar in line.bars) == 4  # fwd, bwd; 2 phases


def test_the_layer_table_groups_the_run():
    report = profile_report(uniform_chain(1000).profile())
    rows = [(row.name, row.count) for row in report.layers]
    assert rows in ([("h.0–999 × 1,000", 1000)], [("h.0", 1), ("h.1–999 × 999", 999)])


def test_a_page_over_the_limit_is_drawn_again_with_less_detail():
    # 300 layers that all differ: nothing groups, so only the size limit can shrink it
    n = 300
    profile = uniform_chain(n, saved=[100 + i for i in range(n)]).profile()
    report = profile_report(profile)
    full = render_report(report, ".html")
    assert len(full) <= MAX_HTML_BYTES
    limit = len(full) * 2 // 3
    page = render_report(report, ".html", max_html_bytes=limit)
    assert len(page) <= limit
    assert len(full) > limit


def test_less_detail_keeps_the_peak_and_halves_the_bars():
    n = 300
    report = profile_report(uniform_chain(n, saved=[100 + i for i in range(n)]).profile())
    smaller = coarser(report)
    assert smaller.timeline.peak_bytes == report.timeline.peak_bytes
    assert len(smaller.timeline.bars) <= len(report.timeline.bars) // 2 + 3
