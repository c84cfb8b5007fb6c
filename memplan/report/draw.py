"""Draw a :class:`memplan.report.data.Report` with matplotlib: SVG for the HTML page, PNG
for READMEs and CI summaries. The only module of memplan that imports matplotlib, and only
inside functions (``import memplan.report`` stays cheap and works without it).

Charts are drawn from the report's numbers only; nothing here computes a byte count.
"""

from __future__ import annotations

import io
import textwrap
from typing import Any

from memplan.errors import BadInputError
from memplan.report.data import KIND_LABELS, KINDS, Report, Timeline
from memplan.units import GiB, KiB, MiB, format_bytes, format_seconds

# Colour-blind-safe palette (Okabe & Ito 2008, "Color Universal Design"), one per kind.
KIND_COLORS = {
    "params": "#0072B2",
    "grads": "#CC79A7",
    "optimizer": "#56B4E9",
    "activations": "#009E73",
    "transient": "#E69F00",
    "reserve": "#999999",
}
BUDGET_COLOR = "#D55E00"
MEASURED_COLOR = "#000000"
CHECKPOINT_SHADE = "#F0E442"
INSTALL_HINT = "pip install 'memplan[report]'"


def matplotlib_pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend, or a clear error (exit 2)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise BadInputError(
            "memplan report draws its charts with matplotlib, which is not installed.",
            hint=f"Install the optional extra: {INSTALL_HINT}",
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if max_bytes >= scale:
            return float(scale), name
    return 1.0, "bytes"


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive True values."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _budget_on_chart(report: Report, top: int) -> bool:
    """Draw the budget line only when it is within 3× of what is drawn: a budget far
    above the peak would flatten every bar to the axis."""
    return bool(report.budget_bytes) and (report.budget_bytes or 0) <= 3 * max(top, 1)


def _checkpoint_band(bars: Any) -> list[bool]:
    flags = [b.checkpointed for b in bars]
    for i, b in enumerate(bars):
        if b.active != "none" or flags[i]:
            continue
        before = next((bars[j] for j in range(i - 1, -1, -1) if bars[j].active != "none"), None)
        after = next((bars[j] for j in range(i + 1, len(bars)) if bars[j].active != "none"), None)
        flags[i] = bool(
            before
            and after
            and before.checkpointed
            and after.checkpointed
            and before.micro_step == b.micro_step == after.micro_step
        )
    return flags


def _short(name: str, limit: int = 18) -> str:
    return name if len(name) <= limit else "…" + name[-(limit - 1) :]


def timeline_axes(ax: Any, report: Report) -> None:
    """Stacked live bytes per segment, the total as a step line, the peak marked, budget and
    margin lines, checkpointed layers shaded, the measured timeline overlaid."""
    line: Timeline = report.timeline
    bars = line.bars
    n = len(bars)
    top = max(line.peak_bytes, report.measured.peak_bytes if report.measured else 0)
    budget_shown = _budget_on_chart(report, top)
    if budget_shown:
        top = max(top, report.budget_bytes or 0)
    scale, unit = _unit(top)
    edges = list(range(n + 1))

    def stepped(values: list[float]) -> list[float]:
        return [*values, values[-1]]

    bottom = [0.0] * n
    for kind in KINDS:
        values = [getattr(b, kind) / scale for b in bars]
        if not any(values):
            continue
        upper = [lo + v for lo, v in zip(bottom, values, strict=True)]
        ax.fill_between(
            edges,
            stepped(bottom),
            stepped(upper),
            step="post",
            color=KIND_COLORS[kind],
            linewidth=0,
            label=KIND_LABELS[kind],
        )
        bottom = upper
    totals = [b.total_bytes / scale for b in bars]
    total_line = ax.plot(
        edges, stepped(totals), drawstyle="steps-post", color="#333333", linewidth=0.8
    )[0]
    total_line.set_gid("predicted-total")

    # Checkpointed layers: their forward and their recompute-and-backward are shaded (and
    # the glue between two checkpointed layers, so a run of them reads as one band).
    for start, end in _runs(_checkpoint_band(bars)):
        ax.axvspan(start, end, color=CHECKPOINT_SHADE, alpha=0.35, linewidth=0, zorder=0)
    if any(b.checkpointed for b in bars):
        ax.fill_between([], [], [], color=CHECKPOINT_SHADE, alpha=0.35, label="checkpointed layer")

    # Micro-step boundaries and their names.
    starts = [i for i, b in enumerate(bars) if i == 0 or b.micro_step != bars[i - 1].micro_step]
    for i in starts[1:]:
        ax.axvline(i, color="#555555", linewidth=0.8, linestyle="-")
    for j, i in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else n
        ax.text(
            (i + end) / 2,
            1.01,
            bars[i].micro_step,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=8,
        )

    # Forward / backward of the layers as x ticks, thinned to stay readable.
    ticks = [
        (i, f"{'F' if b.active == 'fwd' else 'B'} {_short(b.layer or '')}")
        for i, b in enumerate(bars)
        if b.active != "none" and (i == 0 or bars[i - 1].layer != b.layer)
    ]
    ticks.append((n - 1, "optimizer" if bars[-1].phase == "optimizer_step" else "peak"))
    stride = max(1, len(ticks) // 24)
    shown = ticks[::stride] if ticks[-1] in ticks[::stride] else [*ticks[::stride], ticks[-1]]
    ax.set_xticks(
        [i + 0.5 for i, _ in shown], [t for _, t in shown], rotation=90 if n > 1 else 0, fontsize=6
    )
    ax.set_xlim(0, n)

    if report.budget_bytes and not budget_shown:
        ax.text(
            0.005,
            top / scale * 1.02,
            f"budget {format_bytes(report.budget_bytes)}: far above, off the chart",
            color=BUDGET_COLOR,
            fontsize=8,
            va="bottom",
            transform=ax.get_yaxis_transform(),
        )
    if budget_shown:
        ax.axhline(report.budget_bytes / scale, color=BUDGET_COLOR, linewidth=1.2)
        ax.text(
            0.005,
            report.budget_bytes / scale,
            f"budget {format_bytes(report.budget_bytes)}",
            color=BUDGET_COLOR,
            fontsize=8,
            va="bottom",
            transform=ax.get_yaxis_transform(),
        )
    if budget_shown and report.usable_bytes and report.usable_bytes != report.budget_bytes:
        ax.axhline(report.usable_bytes / scale, color=BUDGET_COLOR, linewidth=1, linestyle="--")
        ax.text(
            0.005,
            report.usable_bytes / scale,
            f"budget less safety margin {format_bytes(report.usable_bytes)}",
            color=BUDGET_COLOR,
            fontsize=8,
            va="top",
            transform=ax.get_yaxis_transform(),
        )

    if report.measured is not None:
        _measured_overlay(ax, report, scale)

    peak = bars[line.peak_index]
    ax.plot([line.peak_index + 0.5], [peak.total_bytes / scale], marker="v", color="#D00000")
    ax.annotate(
        f"peak {format_bytes(peak.total_bytes)}\n{peak.where} · {peak.micro_step}",
        xy=(line.peak_index + 0.5, peak.total_bytes / scale),
        xytext=(0.4, 0.97),
        textcoords="axes fraction",
        ha="center",
        va="top",
        fontsize=9,
        bbox={"boxstyle": "round", "fc": "white", "ec": "#D00000"},
        arrowprops={"arrowstyle": "->", "color": "#D00000"},
    )
    ax.set_ylim(0, top / scale * 1.4)
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(
        f"Predicted memory over one optimizer step (micro-batch {line.micro_batch}, "
        f"accumulation {line.accumulation_steps})",
        fontsize=10,
        pad=16,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, framealpha=0.9)


def _measured_overlay(ax: Any, report: Report, scale: float) -> None:
    """Each measured micro-step spread over its predicted one's bars: levels are exact,
    positions within a micro-step follow op order (not time)."""
    measured = report.measured
    assert measured is not None
    bars = report.timeline.bars
    ranges: dict[str, tuple[int, int]] = {}
    for i, b in enumerate(bars):
        lo, _ = ranges.get(b.phase, (i, i))
        ranges[b.phase] = (lo, i + 1)
    forward = list(measured.forward_ops) + [None] * len(measured.micro_steps)
    pieces: list[tuple[str, tuple[int, ...], int | None]] = []
    if measured.micro_steps:
        pieces.append(("no_grads", measured.micro_steps[0], forward[0]))
        later = list(enumerate(measured.micro_steps))[1:]
        if later:
            i, values = max(later, key=lambda item: max(item[1], default=0))
            pieces.append(("grads_resident", values, forward[i]))
    pieces.append(("optimizer_step", measured.optimizer_step, None))
    first = True
    for phase, values, forward_ops in pieces:
        if phase not in ranges or not values:
            continue
        lo, hi = ranges[phase]
        # Ops up to the end of the model's forward over the forward's bars, the rest over
        # the loss and backward; each part spread evenly (op order, not time).
        split = next((i for i in range(lo, hi) if bars[i].after_forward), hi)
        parts = [(values, lo, hi)]
        if forward_ops is not None and lo < split < hi:
            parts = [(values[:forward_ops], lo, split), (values[forward_ops:], split, hi)]
        xs: list[float] = []
        for part, start, end in parts:
            count = len(part)
            xs += [start + (end - start) * (j + 0.5) / count for j in range(count)]
        artist = ax.plot(
            xs,
            [v / scale for v in values],
            color=MEASURED_COLOR,
            linewidth=0.7,
            label=f"{measured.label}, peak {format_bytes(measured.peak_bytes)}" if first else None,
        )[0]
        artist.set_gid("measured")
        first = False


def _candidate_label(row: Any, strategies: set[str]) -> str:
    label = f"{row.micro_batch}×{row.accumulation_steps}"
    return f"{row.strategy} {label}" if len(strategies) > 1 else label


def candidates_axes(ax_peak: Any, ax_time: Any, report: Report) -> None:
    """Predicted peak and step time per candidate (micro-batch × accumulation): the chosen
    one highlighted, the others annotated with why they lost."""
    rows = report.candidates
    strategies = {r.strategy for r in rows}
    labels = [_candidate_label(r, strategies) for r in rows]
    top = max(r.peak_bytes for r in rows)
    budget_shown = _budget_on_chart(report, top)
    if budget_shown:
        top = max(top, report.budget_bytes or 0)
    scale, unit = _unit(top)
    colors = [
        "#009E73"
        if r.chosen
        else ("#0072B2" if r.feasible else ("#999999" if r.fits else "#D55E00"))
        for r in rows
    ]
    xs = list(range(len(rows)))
    ax_peak.bar(xs, [r.peak_bytes / scale for r in rows], color=colors, edgecolor="#333333")
    floor = (report.budget_bytes or 0) / scale if budget_shown else 0
    for x, row in zip(xs, rows, strict=True):
        note = row.note + (f" · {row.n_checkpointed} ckpt" if row.n_checkpointed else "")
        ax_peak.text(
            x,
            max(row.peak_bytes / scale, floor),
            " " + note,
            rotation=90,
            ha="center",
            va="bottom",
            fontsize=7,
            fontweight="bold" if row.chosen else "normal",
        )
    if budget_shown:
        ax_peak.axhline(report.budget_bytes / scale, color=BUDGET_COLOR, linewidth=1.2)
    if budget_shown and report.usable_bytes and report.usable_bytes != report.budget_bytes:
        ax_peak.axhline(
            report.usable_bytes / scale, color=BUDGET_COLOR, linewidth=1, linestyle="--"
        )
    ax_peak.set_ylim(0, top / scale * 1.9)
    ax_peak.set_xticks(xs, labels, rotation=45 if len(rows) > 6 else 0, fontsize=8)
    ax_peak.set_xlabel("micro-batch × accumulation")
    ax_peak.set_ylabel(f"predicted peak ({unit})")
    ax_peak.set_title("Candidates: peak vs budget (green: chosen, red: over budget)", fontsize=10)

    times = [r.step_seconds for r in rows]
    ax_time.bar(xs, times, color=colors, edgecolor="#333333")
    for x, row in zip(xs, rows, strict=True):
        if row.step_seconds > 0:
            ax_time.text(
                x,
                row.step_seconds,
                format_seconds(row.step_seconds),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax_time.set_xticks(xs, labels, rotation=45 if len(rows) > 6 else 0, fontsize=8)
    ax_time.set_xlabel("micro-batch × accumulation")
    ax_time.set_ylabel("predicted time per optimizer step (s)")
    ax_time.set_ylim(0, max(times, default=1) * 1.2 or 1)
    ax_time.set_title("Candidates: step time (lower is faster)", fontsize=10)


def timeline_figure(report: Report) -> Any:
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(12, 5.2), layout="constrained")
    timeline_axes(ax, report)
    return fig


def candidates_figure(report: Report) -> Any:
    plt = matplotlib_pyplot()
    fig, (ax_peak, ax_time) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    candidates_axes(ax_peak, ax_time, report)
    return fig


def combined_figure(report: Report) -> Any:
    """Timeline above candidates, in one figure (the PNG)."""
    plt = matplotlib_pyplot()
    if report.candidates:
        fig = plt.figure(figsize=(12, 9.6), layout="constrained")
        grid = fig.add_gridspec(2, 2, height_ratios=[5.2, 4.2])
        timeline_axes(fig.add_subplot(grid[0, :]), report)
        candidates_axes(fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1]), report)
    else:
        fig = timeline_figure(report)
    fig.suptitle(report.title, fontsize=10)
    if report.notes:
        fig.supxlabel("\n".join(textwrap.wrap(" ".join(report.notes), 180)), fontsize=7)
    return fig


def svg_text(fig: Any) -> str:
    """The figure as an inline SVG element (no XML prolog, no external references)."""
    plt = matplotlib_pyplot()
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "path", "svg.hashsalt": "memplan"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    plt = matplotlib_pyplot()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()
