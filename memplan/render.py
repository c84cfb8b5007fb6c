"""Everything a person sees: rich tables, bars and error paragraphs, on stderr.

The only module that imports rich. It turns the library's data (Profile, Plan, solver
results, errors) into text once, at the edge; nothing here computes a number that a test
should check — the numbers come from the pure modules."""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from memplan.errors import MemplanError
from memplan.plan import Plan
from memplan.profile import Affine, Profile
from memplan.units import format_bytes, format_seconds

console = Console(stderr=True, highlight=False)
stdout = Console(highlight=False, soft_wrap=True)

_BREAKDOWN_COLORS = {
    "params": "blue",
    "grads": "magenta",
    "optimizer": "cyan",
    "activations": "green",
    "transient": "yellow",
    "reserve": "red",
}


# ---------------------------------------------------------------- errors and messages
def error(exc: MemplanError, *, debug: bool = False) -> None:
    """One paragraph naming what went wrong and what to do; the traceback only with --debug."""
    if debug:
        console.print(Text("".join(traceback.format_exception(exc))), style="dim")
    text = Text("error: ", style="bold red")
    text.append(exc.message)
    if exc.hint:
        text.append(" " + exc.hint)
    console.print(text)


def warn(message: str) -> None:
    console.print(Text("warning: ", style="bold yellow") + Text(message))


def info(message: str) -> None:
    console.print(Text(message))


@contextlib.contextmanager
def progress(description: str) -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar driven by the library's ``on_progress(done, total, what)`` callbacks."""
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[what]}", style="dim"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task(description, total=None, what="")

    def update(done: int, total: int, what: str) -> None:
        bar.update(task, completed=done, total=total, what=what)

    with bar:
        yield update


# ---------------------------------------------------------------- profile
def _affine_cell(value: Affine, batch: int, *, seconds: bool = False) -> str:
    fmt = format_seconds if seconds else format_bytes
    at = value.at(batch)
    if abs(value.slope) < 1e-12:
        return fmt(at)
    return f"{fmt(at)} [dim]+{fmt(value.slope)}/s[/dim]"


def _flops(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f}"


def profile_table(profile: Profile) -> Table:
    """One row per layer and fixed part, values at the largest probed micro-batch with the
    per-sample slope beside them (``+x/s``: per sample)."""
    batch = max(profile.micro_batches)
    env = profile.environment
    title = (
        f"{profile.model.path}  ·  {env.device_name} ({env.device})  ·  {env.precision}  ·  "
        f"{env.optimizer_class}  ·  values at micro-batch {batch}, +slope per sample"
    )
    table = Table(title=title, title_justify="left", header_style="bold", show_lines=False)
    for column in ("layer", "type", "params (train/frozen)", "grads", "optim state",
                   "input", "saved", "ckpt saves", "fwd peak", "fwd time", "bwd time",
                   "fwd FLOPs", "fit"):
        table.add_column(column, justify="left" if column in ("layer", "type") else "right")
    for part in profile.fixed:
        table.add_row(
            f"[italic]{part.name}[/italic]", part.module_type,
            f"{format_bytes(part.params_trainable_bytes)} / {format_bytes(part.params_frozen_bytes)}",
            format_bytes(part.grad_bytes), format_bytes(part.optimizer_state_bytes),
            "", _affine_cell(part.saved_bytes, batch), "", "",
            _affine_cell(part.fwd_seconds, batch, seconds=True),
            _affine_cell(part.bwd_seconds, batch, seconds=True),
            _flops(part.fwd_flops.at(batch)), "",
        )
    for layer in profile.layers:
        fit = "ok" if layer.affine else f"[red]non-affine ({layer.saved_bytes.residual:.1%})[/red]"
        table.add_row(
            layer.name, layer.module_type,
            f"{format_bytes(layer.params_trainable_bytes)} / {format_bytes(layer.params_frozen_bytes)}",
            format_bytes(layer.grad_bytes), format_bytes(layer.optimizer_state_bytes),
            _affine_cell(layer.input_bytes, batch), _affine_cell(layer.saved_bytes, batch),
            _affine_cell(layer.savings_bytes, batch), _affine_cell(layer.fwd_transient_bytes, batch),
            _affine_cell(layer.fwd_seconds, batch, seconds=True),
            _affine_cell(layer.bwd_seconds, batch, seconds=True),
            _flops(layer.fwd_flops.at(batch)), fit,
        )
    totals = profile.totals
    table.add_section()
    table.add_row(
        "[bold]total[/bold]", "",
        f"{format_bytes(totals.params_trainable_bytes)} / {format_bytes(totals.params_frozen_bytes)}",
        format_bytes(totals.grad_bytes), format_bytes(totals.optimizer_state_bytes),
        "", _affine_cell(_sum_affine([p.saved_bytes for p in profile.layers]
                                     + [p.saved_bytes for p in profile.fixed]), batch),
        "", "", "", "", "", "",
    )
    return table


def _sum_affine(values: list[Affine]) -> Affine:
    return Affine(intercept=sum(v.intercept for v in values), slope=sum(v.slope for v in values))


def show_profile(profile: Profile, *, peaks: dict[int, int] | None = None) -> None:
    console.print(profile_table(profile))
    if peaks:
        cells = ", ".join(f"b={b}: {format_bytes(v)}" for b, v in sorted(peaks.items()))
        console.print(f"Measured whole-step peak (no checkpointing, accumulation 1): {cells}")
    if not profile.op_sequence_stable:
        warn("the op sequence differed between probed sizes (data-dependent routing); "
             "verify plans at their micro-batch with `memplan verify`.")
    for message in profile.warnings:
        warn(message)


# ---------------------------------------------------------------- plan
def breakdown_bar(plan: Plan, width: int = 60) -> Text:
    """A stacked bar of the predicted peak by term, scaled to the budget."""
    scale = max(plan.budget_bytes, plan.predicted.peak_bytes)
    text = Text()
    used = 0
    parts = plan.predicted.breakdown
    for name, color in _BREAKDOWN_COLORS.items():
        value = max(getattr(parts, name), 0)
        cells = round(width * value / scale) if scale else 0
        used += cells
        text.append("█" * cells, style=color)
    text.append("░" * max(width - used, 0), style="dim")
    text.append(f"  {format_bytes(plan.predicted.peak_bytes)} of {format_bytes(plan.budget_bytes)}")
    legend = Text("\n")
    for name, color in _BREAKDOWN_COLORS.items():
        legend.append("■ ", style=color)
        legend.append(f"{name} {format_bytes(getattr(parts, name))}  ")
    return text + legend


def compact_names(names: tuple[str, ...] | list[str]) -> str:
    """``h.0 h.1 h.2 h.5`` -> ``h.0-2, h.5``: runs of numbered siblings folded."""
    if not names:
        return "none"
    groups: list[tuple[str, int, int]] = []
    loose: list[str] = []
    for name in names:
        prefix, _, last = name.rpartition(".")
        if last.isdigit():
            index = int(last)
            if groups and groups[-1][0] == prefix and groups[-1][2] == index - 1:
                groups[-1] = (prefix, groups[-1][1], index)
                continue
            groups.append((prefix, index, index))
        else:
            loose.append(name)
    parts = [f"{p}.{a}" if a == b else f"{p}.{a}-{b}" for p, a, b in groups]
    return ", ".join(parts + loose)


def show_plan(plan: Plan) -> None:
    predicted = plan.predicted
    lines = Text()
    lines.append(f"micro-batch {plan.micro_batch_size} × accumulation {plan.accumulation_steps}"
                 f" × world {plan.world_size} = effective batch {plan.target_batch}\n", style="bold")
    lines.append(f"checkpoint {len(plan.checkpoint_layers)} layer(s): "
                 f"{compact_names(plan.checkpoint_layers)}\n")
    lines.append(f"precision {plan.precision} · device {plan.device}\n")
    lines.append("predicted peak ")
    lines.append(breakdown_bar(plan))
    lines.append(f"\npeak during: {predicted.peak_phase or 'n/a'}\n")
    lines.append(f"predicted time per optimizer step {format_seconds(predicted.step_seconds)}"
                 f" · {plan.samples_per_second:,.1f} samples/s")
    console.print(Panel(lines, title="memplan plan", title_align="left"))
    if plan.reasons:
        console.print("[bold]why[/bold]")
        for reason in plan.reasons:
            console.print(f"  • {reason}")
    for message in plan.warnings:
        warn(message)


def candidates_table(rows: list[dict[str, Any]], chosen_micro: int | None) -> Table:
    """The Pareto candidates, one row per micro-batch; ``rows`` are plain dicts with keys
    micro_batch, accumulation_steps, n_checkpointed, peak_bytes, step_seconds, feasible, note."""
    table = Table(title="candidates (one per micro-batch)", title_justify="left",
                  header_style="bold")
    for column in ("micro", "accum", "ckpt layers", "peak", "step time", "relative throughput",
                   "note"):
        table.add_column(column, justify="left" if column == "note" else "right")
    best = next((r for r in rows if r["micro_batch"] == chosen_micro), None)
    for row in rows:
        relative = ""
        if best and row.get("feasible") and row["step_seconds"] > 0:
            relative = f"{best['step_seconds'] / row['step_seconds']:.2f}×"
        style = "bold green" if row["micro_batch"] == chosen_micro else (
            None if row.get("feasible") else "dim")
        peak = row.get("peak_bytes")
        table.add_row(
            str(row["micro_batch"]), str(row["accumulation_steps"]),
            "" if row.get("n_checkpointed") is None else str(row["n_checkpointed"]),
            "" if peak is None or (isinstance(peak, float) and math.isnan(peak)) else format_bytes(peak),
            format_seconds(row["step_seconds"]) if row.get("step_seconds") else "",
            relative, row.get("note", ""), style=style,
        )
    return table


def show_candidates(rows: list[dict[str, Any]], chosen_micro: int | None) -> None:
    console.print(candidates_table(rows, chosen_micro))


def print_json(data: Any) -> None:
    """One machine-readable object on stdout."""
    import json

    stdout.out(json.dumps(data, indent=2, default=str), highlight=False)
