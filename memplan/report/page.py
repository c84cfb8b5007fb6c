"""The self-contained HTML page of a report: inline SVG charts, tables, no script, nothing
fetched (no external stylesheet, font, image or script; opens from a file)."""

from __future__ import annotations

import html
import re

from memplan.modes import SPEC
from memplan.report.data import Report
from memplan.units import format_bytes, format_seconds

_STYLE = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px;
       color: #222; max-width: 1280px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.chart svg { width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: right; }
th { background: #f4f4f4; }
td.name { text-align: left; overflow-wrap: anywhere; max-width: 420px; }
tr.ckpt td { background: #fbf7d0; }
.note { background: #fff4e5; border-left: 4px solid #E69F00; padding: 6px 10px; }
.peak { font-weight: bold; }
"""

_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.DOTALL)


def _clean_svg(svg: str) -> str:
    """Drop matplotlib's RDF metadata (it names URLs the page would never load, but a
    reader checking for them should not have to tell the difference)."""
    return _METADATA.sub("", svg)


def _layer_table(report: Report) -> str:
    rows = []
    for row in report.layers:
        rows.append(
            f'<tr class="{"ckpt" if row.checkpointed else ""}">'
            f'<td class="name">{html.escape(row.name)}</td>'
            f"<td>{html.escape(row.module_type)}</td>"
            f"<td>{format_bytes(row.held_bytes)}</td>"
            f"<td>{format_bytes(row.savings_bytes)}</td>"
            f"<td>{format_seconds(row.recompute_seconds)}</td>"
            f"<td>{(SPEC[row.mode].label if row.mode in SPEC else html.escape(row.mode))}</td></tr>"
        )
    return (
        '<table id="layers"><thead><tr><th>layer</th><th>type</th>'
        "<th>bytes held for backward</th><th>its mode frees</th>"
        "<th>its mode costs per step</th><th>choice</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )


def _summary(report: Report) -> str:
    line = report.timeline
    peak = line.bars[line.peak_index]
    items = [
        f'<li class="peak">predicted peak {format_bytes(peak.total_bytes)} '
        f"({peak.total_bytes:,} bytes): {html.escape(peak.where)}, "
        f"{html.escape(peak.micro_step)}</li>"
    ]
    if report.budget_bytes:
        items.append(
            f"<li>budget {format_bytes(report.budget_bytes)}; less the safety margin "
            f"{format_bytes(report.usable_bytes or report.budget_bytes)}</li>"
        )
    plan = report.plan
    if plan is not None:
        items.append(
            f"<li>predicted time per optimizer step "
            f"{format_seconds(plan.predicted.step_seconds)}</li>"
        )
    return "<ul>" + "".join(items) + "</ul>"


def _reasons(report: Report) -> str:
    if report.plan is None or not report.plan.reasons:
        return ""
    items = "".join(f"<li>{html.escape(reason)}</li>" for reason in report.plan.reasons)
    return f'<h2>Why this plan</h2><ul id="reasons">{items}</ul>'


def _source(report: Report) -> str:
    if report.profile is None:
        return " from the plan alone"
    return f" from {html.escape(report.profile.model.path)}'s profile"


def render_html(report: Report, *, timeline_svg: str, candidates_svg: str | None) -> str:
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in report.notes)
    if report.plan is not None:
        notes += "".join(
            f'<p class="note">warning: {html.escape(w)}</p>' for w in report.plan.warnings
        )
    candidates = (
        '<h2>Candidates</h2><div class="chart" id="candidates-chart">'
        + _clean_svg(candidates_svg)
        + "</div>"
        if candidates_svg
        else ""
    )
    measured = (
        "Black line: the measured live bytes after every op (levels exact; positions within "
        "a micro-step follow op order). "
        if report.measured is not None
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>memplan report: {html.escape(report.title)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>memplan report</h1>
<p>{html.escape(report.title)}</p>
{notes}
{_summary(report)}
<h2>Where the peak is</h2>
<p>Each bar is one segment of the step (a layer's forward or backward, or the parts between
them), stacked by what holds the bytes; the height of each bar is memplan's prediction, the
split an estimate. Shaded: checkpointed layers. {measured}</p>
<div class="chart" id="timeline-chart">{_clean_svg(timeline_svg)}</div>
{candidates}
<h2>Layers</h2>
{_layer_table(report)}
{_reasons(report)}
<p>Written by memplan{_source(report)}.</p>
</body></html>
"""
