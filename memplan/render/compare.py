"""``memplan solve --compare``'s table: one row per profile solved alike (memplan.solver.compare),
the chosen one in bold green. Text only from the comparison's figures; every name is wrapped
in ``Text``, so rich markup in a file name is shown, not obeyed."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from memplan.plan import Plan
from memplan.render import checkpoint_names, console
from memplan.solver.compare import Comparison
from memplan.units import format_bytes, format_seconds


def _layout(plan: Plan) -> str:
    if plan.parallel is not None:
        return plan.parallel.describe() + f" · {plan.strategy}"
    return f"{plan.strategy} × {plan.world_size}" if plan.world_size > 1 else plan.strategy


def comparison_table(comparison: Comparison) -> Table:
    table = Table(
        title="profiles compared (same request)", title_justify="left", header_style="bold"
    )
    table.add_column("profile", overflow="fold")
    table.add_column("precision", no_wrap=True)
    table.add_column("layout")
    table.add_column("micro × accum", justify="right", no_wrap=True)
    table.add_column("checkpoint")
    table.add_column("peak", justify="right", no_wrap=True)
    table.add_column("step time", justify="right", no_wrap=True)
    table.add_column("fits", no_wrap=True)
    table.add_column("vs chosen", justify="right", no_wrap=True)
    chosen = comparison.result
    best_seconds = chosen.plan.predicted.step_seconds if chosen is not None else None
    for index, row in enumerate(comparison.rows):
        plan = row.result.plan if row.result is not None else None
        if plan is None and row.no_fit is not None:
            plan = row.no_fit.closest
        if row.result is not None:
            fits = "chosen" if index == comparison.chosen else "yes"
        else:
            least = row.no_fit.min_peak_bytes if row.no_fit is not None else None
            fits = "no" + (f": needs {format_bytes(least)}" if least is not None else "")
        ratio = ""
        if row.result is not None and best_seconds:
            ratio = f"{row.result.plan.predicted.step_seconds / best_seconds:.2f}×"
        cells = [Text(row.path), Text(row.precision)]
        if plan is None:
            cells += [Text("")] * 5
        else:
            cells += [
                Text(_layout(plan)),
                f"{plan.micro_batch_size} × {plan.accumulation_steps}",
                Text(
                    f"{len(plan.checkpoint)}: {checkpoint_names(plan)}"
                    if plan.checkpoint
                    else "none"
                ),
                format_bytes(plan.predicted.peak_bytes),
                format_seconds(plan.predicted.step_seconds) if row.result is not None else "",
            ]
        style = "bold green" if index == comparison.chosen else (None if row.result else "dim")
        table.add_row(*cells, Text(fits), ratio, style=style)
    return table


def show_comparison(comparison: Comparison) -> None:
    console.print(comparison_table(comparison))
