"""Everything a person sees: rich tables, bars and error paragraphs, on stderr.

The render package is the only place memplan imports rich (``memplan.render.check`` draws
``memplan check``'s report). It turns the library's data (Profile, Plan, solver
results, errors) into text once, at the edge; nothing here computes a number that a test
should check — the numbers come from the pure modules."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from memplan import timing
from memplan.devices import DeviceSpec
from memplan.errors import MemplanError
from memplan.modes import MODES
from memplan.plan import Plan
from memplan.profile import OP_SEQUENCE_DIFFERED, Affine, Profile, affine_sum
from memplan.report.runs import run_label, runs
from memplan.units import format_bytes, format_seconds

PIPED_WIDTH = 120
"""Columns when output is not a terminal and $COLUMNS is unset: rich would use 80, which
cut numbers to ``2…`` and made long layer names indistinguishable in logs and CI."""


def _width(stream: object) -> int | None:
    """None (rich measures the terminal, or reads $COLUMNS) unless the output is piped
    with no $COLUMNS: then PIPED_WIDTH."""
    isatty = getattr(stream, "isatty", None)
    if os.environ.get("COLUMNS") or (isatty is not None and isatty()):
        return None
    return PIPED_WIDTH


console = Console(stderr=True, highlight=False, width=_width(sys.stderr))
stdout = Console(highlight=False, soft_wrap=True)
_warned: set[str] = set()

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
    console.print(Text("error: ", style="bold red") + Text(str(exc)))


def warn(message: str) -> None:
    """A warning, once per command (``reset_warnings`` starts a command)."""
    if message in _warned:
        return
    _warned.add(message)
    console.print(Text("warning: ", style="bold yellow") + Text(message))


def reset_warnings() -> None:
    _warned.clear()


@contextlib.contextmanager
def warnings_rendered() -> Iterator[None]:
    """Within the block, Python warnings print as memplan's ``warning:`` lines (once per
    message), not as raw ``file:line: UserWarning`` lines."""

    def show(message: Any, category: type, filename: str, lineno: int, *_: Any) -> None:
        text = str(message).removeprefix("memplan: ")
        if category is not UserWarning:
            text = f"{text} ({category.__name__})"
        warn(text)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


def info(message: str) -> None:
    console.print(Text(message))


@contextlib.contextmanager
def progress(description: str, *, quiet: bool = False) -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar on stderr driven by the library's ``on_progress(done, total, what)``
    callbacks (a phase with no count: call it with total 0 or never), showing what it is
    doing and the elapsed time. Silent (the callback does nothing) with ``quiet`` (``--json``).
    When stderr is not a terminal (a log, a pipe): a plain line every
    ``MEMPLAN_PROGRESS_SECONDS`` (default 60) while it runs, and one at the end of a run that
    printed any, saying what it is doing and where the time went (``_plain_progress``); a
    run shorter than that prints nothing."""
    if quiet:
        yield lambda done, total, what: None
        return
    if not console.is_terminal:
        with _plain_progress(description) as update:
            yield update
        return
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TextColumn("{task.fields[what]}", style="dim"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task(description, total=None, what="", count="")

    def update(done: int, total: int, what: str) -> None:
        count = f"{done}/{total}" if total else ""  # a phase without a count shows none
        bar.update(task, completed=done, total=total or None, what=what, count=count)

    try:  # started inside the try: a signal while the display starts still stops it
        bar.start()
        yield update
    finally:
        bar.stop()


PLAIN_PROGRESS_SECONDS = 60.0
"""Seconds between plain progress lines off a terminal (``MEMPLAN_PROGRESS_SECONDS``)."""


@contextlib.contextmanager
def _plain_progress(description: str) -> Iterator[Callable[[int, int, str], None]]:
    """Plain progress lines on stderr off a terminal: a timer thread prints, every
    ``PLAIN_PROGRESS_SECONDS``, the elapsed time, the phase it is in (and for how long) and
    the phases that took longest so far; a last line when it ends, if any was printed."""
    import threading
    import time

    try:
        every = float(os.environ.get("MEMPLAN_PROGRESS_SECONDS", PLAIN_PROGRESS_SECONDS))
    except ValueError:
        every = PLAIN_PROGRESS_SECONDS
    start = time.monotonic()
    state: dict[str, Any] = {"what": "", "count": "", "since": start, "printed": False}
    spent: dict[str, float] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def slowest() -> str:
        top = sorted(spent.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{what} {format_seconds(secs)}" for what, secs in top if secs >= 1)

    def line(now: float, done: bool) -> str:
        head = f"{description}: {format_seconds(now - start)}"
        if done:
            text = f"{head}, done"
        else:
            where = state["what"] or "starting"
            count = f" ({state['count']})" if state["count"] else ""
            text = f"{head} so far; now {where}{count} for {format_seconds(now - state['since'])}"
        top = slowest()
        return f"{text}; longest steps: {top}" if top else text

    def update(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        with lock:
            if what != state["what"]:
                if state["what"]:
                    key = state["what"]
                    spent[key] = spent.get(key, 0.0) + now - state["since"]
                state["what"], state["since"] = what, now
            state["count"] = f"{done}/{total}" if total else ""

    def tick() -> None:
        while not stop.wait(every):
            with lock:
                console.print(Text(line(time.monotonic(), False)), soft_wrap=True)
                state["printed"] = True

    thread = threading.Thread(target=tick, name="memplan-progress", daemon=True)
    thread.start()
    try:
        yield update
    finally:
        stop.set()
        thread.join()
        update(0, 0, "")
        if state["printed"]:
            console.print(Text(line(time.monotonic(), True)), soft_wrap=True)


# ---------------------------------------------------------------- profile
def _saved_short(value: float) -> str:
    """Saved bytes of a fixed part: the loss can free more per sample than it keeps (the
    logits it consumes), which reads as ``frees 1.0MiB``, not as a negative size."""
    return f"frees {_short_bytes(-value)}" if value < 0 else _short_bytes(value)


def _short_bytes(value: float) -> str:
    """Compact binary size for wide tables, its unit named: ``5.0MiB``, ``640B``."""
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= scale:
            shown = value / scale
            return f"{sign}{shown:.0f}{unit}" if shown >= 100 else f"{sign}{shown:.1f}{unit}"
    return f"{sign}{value:.0f}B"


def _flops(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _ms(value: Affine, batch: int) -> str:
    return f"{value.at(batch) * 1e3:.2f}"


def profile_table(profile: Profile, width: int | None = None) -> Table:
    """``_profile_table``, without the input and FLOPs columns when the whole table would
    not fit ``width`` (default: the console's) even with its names wrapped."""
    limit = width or console.width
    table = _profile_table(profile, narrow=limit < 100)
    unbounded = console.options.update_width(10_000)  # a measurement is capped at its width
    if console.measure(table, options=unbounded).minimum > limit:
        table = _profile_table(profile, narrow=True)
    return table


def _profile_table(profile: Profile, *, narrow: bool) -> Table:
    """One row per fixed part and layer. Activation columns are per sample (the slope of
    the affine fit: bytes grow by this much per sample of micro-batch); time columns are at
    the largest probed micro-batch. Sizes name their binary unit (KiB, MiB, GiB). Below 100
    columns of terminal the input and FLOPs columns are left out."""
    batch = max(profile.micro_batches)
    env = profile.environment
    columns = [
        "layer",
        "params",
        "frozen",
        "grads",
        "optim",
        "input/s",
        "saved/s",
        "ckpt/s",
        "fwd ms",
        "bwd ms",
        "FLOPs",
        "fit",
    ]
    if profile.totals.params_frozen_bytes == 0:
        columns.remove("frozen")
    if narrow:
        columns = [c for c in columns if c not in ("input/s", "FLOPs")]
    table = Table(
        title=(
            f"{escape(profile.model.path)} · {escape(env.device_name)} · {env.precision} · "
            f"{env.optimizer_class} · probed at {','.join(map(str, profile.micro_batches))}"
        ),
        title_justify="left",
        header_style="bold",
        caption=f"/s = per sample; ckpt = bytes checkpointing the layer frees; times at "
        f"micro-batch {batch}",
        caption_justify="left",
    )
    longest = max(
        (len(n) for n in [*profile.layer_names, *(p.name for p in profile.fixed)]), default=5
    )
    for column in columns:
        # Names wrap (whole, folded) when space runs out; numbers never shrink.
        table.add_column(
            column,
            justify="left" if column == "layer" else "right",
            no_wrap=column != "layer",
            overflow="fold",
            min_width=min(longest, 28) if column == "layer" else None,
        )

    def add(cells: dict[str, str]) -> None:
        table.add_row(*(cells.get(column, "") for column in columns))

    def state(part: Any) -> dict[str, str]:
        return {
            "params": _short_bytes(part.params_trainable_bytes),
            "frozen": _short_bytes(part.params_frozen_bytes),
            "grads": _short_bytes(part.grad_bytes),
            "optim": _short_bytes(part.optimizer_state_bytes),
            "fwd ms": _ms(part.fwd_seconds, batch),
            "bwd ms": _ms(part.bwd_seconds, batch),
            "FLOPs": _flops(part.fwd_flops.at(batch)),
        }

    for part in profile.fixed:
        add(
            {
                "layer": f"[italic]{escape(part.name)}[/italic]",
                **state(part),
                "saved/s": _saved_short(part.saved_bytes.slope),
            }
        )
    rows = []
    for layer in profile.layers:
        worst = max(  # the worst fit of the layer's byte counts (what ``affine`` judges)
            getattr(layer, f).residual
            for f in layer.__slots__
            if f.endswith("_bytes") and isinstance(getattr(layer, f), Affine)
        )
        rows.append(
            {
                **state(layer),
                "input/s": _short_bytes(layer.input_bytes.slope),
                "saved/s": _short_bytes(layer.saved_bytes.slope),
                "ckpt/s": _short_bytes(layer.savings_bytes.slope),
                "fit": "ok" if layer.affine else f"[red]{worst:.1%}[/red]",
            }
        )
    # alike neighbours (10,000 identical blocks) share one row: blocks.2–9998 × 9,997, each
    names = profile.layer_names
    for run in runs([tuple(row.items()) for row in rows]):
        label = run_label(names, run) + (", each" if run.count > 1 else "")
        add({"layer": escape(label), **rows[run.start]})
    totals = profile.totals
    saved = affine_sum(
        *(p.saved_bytes for p in profile.layers), *(p.saved_bytes for p in profile.fixed)
    )
    table.add_section()
    add(
        {
            "layer": "[bold]total[/bold]",
            "params": _short_bytes(totals.params_trainable_bytes),
            "frozen": _short_bytes(totals.params_frozen_bytes),
            "grads": _short_bytes(totals.grad_bytes),
            "optim": _short_bytes(totals.optimizer_state_bytes),
            "saved/s": _short_bytes(saved.slope),
        }
    )
    return table


def show_profile(profile: Profile, *, peaks: dict[int, int] | None = None) -> None:
    console.print(profile_table(profile))
    if peaks:
        cells = ", ".join(f"b={b}: {format_bytes(v)}" for b, v in sorted(peaks.items()))
        console.print(f"Measured whole-step peak (no checkpointing, accumulation 1): {cells}")
    said = any(OP_SEQUENCE_DIFFERED in message for message in profile.warnings)
    if not profile.op_sequence_stable and not said:  # a profile of an older memplan
        warn(
            f"the {OP_SEQUENCE_DIFFERED} between probed sizes (data-dependent routing); "
            "verify plans at their micro-batch with `memplan verify`."
        )
    for message in profile.warnings:
        warn(message)
    slow = _selective_note(profile)
    if slow:
        console.print(Text(f"note: {slow}"))
    loose = [layer.name for layer in profile.layers if not layer.affine]
    if loose:
        console.print(
            Text(
                f"note: {len(loose)} of {len(profile.layers)} layers' bytes are not affine in "
                f"the micro-batch (e.g. {loose[0]}); solve warns when a plan's micro-batch lies "
                "outside the probed sizes, where they would be extrapolated"
            )
        )
    if profile.hf_blocks and (profile.tp_refused or profile.pipeline_refused):
        # a transformers model: layouts are what a user may plan next
        for what, why in (("--tp", profile.tp_refused), ("--pp", profile.pipeline_refused)):
            if why:
                console.print(Text(f"note: solve refuses {what} > 1: {why}"))
    if profile.ddp_refused:
        console.print(Text(f"note: solve refuses DDP on several ranks: {profile.ddp_refused}"))


def _selective_note(profile: Profile) -> str:
    """A line when the probe measured selective checkpointing no faster than full on some
    layers at the largest probed micro-batch (solve then never picks it there)."""
    if not profile.micro_batches or profile.environment.device == "meta":
        return ""
    size = max(profile.micro_batches)
    try:
        times = timing.measured_times(profile, size)
    except ValueError:
        return ""
    slower = timing.selective_slower_layers(times)
    if not slower:
        return ""
    names = compact_names([profile.layer_names[i] for i in slower])
    first = slower[0]
    return (
        f"selective checkpointing measured no faster than full recompute on {len(slower)} "
        f"of {len(profile.layers)} layer(s) at micro-batch {size} ({names}; e.g. "
        f"+{format_seconds(times.mode_seconds(first, 'selective'))} against "
        f"+{format_seconds(times.mode_seconds(first, 'full'))} per micro-step): solve does "
        "not choose it there."
    )


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


def checkpoint_names(plan: Plan) -> str:
    """The plan's checkpointed layers, folded (:func:`compact_names`); with more than one
    mode, each group followed by its mode: ``h.0-1 full, h.5 selective``."""
    by_mode: dict[str, list[str]] = {}
    for name, mode in plan.checkpoint.items():
        by_mode.setdefault(mode, []).append(name)
    if set(by_mode) <= {"full"}:
        return compact_names(plan.checkpoint_layers)
    return ", ".join(f"{compact_names(by_mode[mode])} {mode}" for mode in MODES if mode in by_mode)


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
    lines.append(
        f"micro-batch {plan.micro_batch_size} × accumulation {plan.accumulation_steps}"
        + (
            f" × world {plan.world_size}"
            if plan.parallel is None
            else f" × dp {plan.parallel.dp} ({plan.parallel.describe()}, {plan.world_size} ranks)"
        )
        + f" = effective batch {plan.target_batch}"
        + (
            f" of {plan.seq_len} tokens ({plan.target_batch * plan.seq_len} tokens)"
            if plan.seq_len
            else ""
        )
        + "\n",
        style="bold",
    )
    lines.append(f"checkpoint {len(plan.checkpoint_layers)} layer(s): {checkpoint_names(plan)}\n")
    sharding = (
        f" · strategy {plan.strategy}" if plan.world_size > 1 or plan.strategy != "ddp" else ""
    )
    per_rank = " per rank" if plan.world_size > 1 else ""
    device = plan.device + (" (no named device: no CUDA reserve)" if plan.device == "meta" else "")
    lines.append(f"precision {plan.precision} · device {device}{sharding}\n")
    lines.append(f"predicted peak{per_rank} ")
    lines.append(breakdown_bar(plan))
    lines.append(f"\npeak during: {predicted.peak_phase or 'n/a'}\n")
    lines.append(
        f"predicted time per optimizer step {format_seconds(predicted.step_seconds)}"
        f" · {plan.samples_per_second:,.1f} samples/s"
    )
    console.print(Panel(lines, title="memplan plan", title_align="left"))
    if plan.reasons:
        console.print("[bold]why[/bold]")
        for reason in plan.reasons:
            console.print(Text(f"  • {reason}"))
    for message in plan.warnings:
        warn(message)


def candidates_table(rows: list[dict[str, Any]], chosen_micro: int | None) -> Table:
    """The candidates behind the choice, one row per (strategy,) micro-batch; ``rows`` are
    plain dicts of memplan.solver.Candidate fields."""
    strategies = {row.get("strategy", "ddp") for row in rows}
    columns = ["micro", "accum", "ckpt layers", "peak", "step time", "rel. speed", "note"]
    if strategies != {"ddp"}:
        columns.insert(0, "strategy")
    table = Table(title="candidates", title_justify="left", header_style="bold")
    for column in columns:
        table.add_column(
            column,
            justify="left" if column in ("note", "strategy") else "right",
            no_wrap=column != "note",  # the note wraps; numbers are never cut
        )
    best = next((r for r in rows if r.get("chosen")), None)
    for row in rows:
        relative = ""
        if best and row.get("feasible") and row["step_seconds"] > 0:
            relative = f"{best['step_seconds'] / row['step_seconds']:.2f}×"
        style = "bold green" if row is best else (None if row.get("feasible") else "dim")
        peak = row.get("peak_bytes")
        cells = [
            str(row["micro_batch"]),
            str(row["accumulation_steps"]),
            "" if row.get("n_checkpointed") is None else str(row["n_checkpointed"]),
            "" if peak is None else format_bytes(peak),
            format_seconds(row["step_seconds"]) if row.get("step_seconds") else "",
            relative,
            escape(str(row.get("note", ""))),
        ]
        if "strategy" in columns:
            cells.insert(0, row.get("strategy", "ddp"))
        table.add_row(*cells, style=style)
    return table


def show_candidates(rows: list[dict[str, Any]], chosen_micro: int | None) -> None:
    console.print(candidates_table(rows, chosen_micro))


def json_safe(data: Any) -> Any:
    """``data`` with every NaN or infinite float replaced by ``null``: JSON has no NaN, and a
    consumer's parser must never choke on memplan's output."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: json_safe(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(value) for value in data]
    return data


def print_json(data: Any) -> None:
    """One machine-readable object on stdout (strict JSON: no NaN or Infinity)."""
    import io
    import json

    # Piece by piece into one buffer (json.dumps with an indent joins a list of every piece:
    # +220 MiB of peak for a 10,000-layer profile's 37 MiB), written only once it is whole
    # (an encoding error prints no half object), and straight to the stream: rich would
    # split 50 MB into segments first (1.3 GB and a minute).
    encoder = json.JSONEncoder(indent=2, default=str, allow_nan=False)
    buffer = io.StringIO()
    buffer.writelines(encoder.iterencode(json_safe(data)))
    buffer.write("\n")
    stdout.file.write(buffer.getvalue())
    stdout.file.flush()


# ---------------------------------------------------------------- verify
# ---------------------------------------------------------------- devices
def show_devices(specs: list[DeviceSpec]) -> None:
    """The GPU specs memplan can plan for, one row each; rates to 3 significant figures,
    whole from 1000 on (before, the CPU's 100 GFLOP/s bf16 read "0" and its fp32 "0.1")."""
    rate = lambda x: f"{x:.{max(3, len(str(round(x))))}g}"  # noqa: E731  # 0.1, 30.3, 3350
    table = Table(header_style="bold")
    for column in ("name", "GPU", "memory", "bf16 TFLOP/s", "fp32 TFLOP/s", "bandwidth"):
        table.add_column(column)
    table.add_column("efficiency\nmatmul/attn/mem")
    for s in specs:
        e = s.efficiency
        table.add_row(
            Text(s.name),
            Text(s.display_name),
            format_bytes(s.memory_bytes) if s.memory_bytes else "-",
            rate(s.bf16_flops / 1e12) if s.bf16_flops else "-",
            rate(s.fp32_flops / 1e12),
            f"{rate(s.memory_bandwidth / 1e9)} GB/s",
            f"{e.matmul:.2f}/{e.attention:.2f}/{e.memory:.2f}" if e != type(e)() else "peaks",
        )
    console.print(table)
