"""``memplan verify``'s output: predicted against measured (one process or per rank), the
step time with its spread and the machine's load, the plan check and the batch coupling,
then the verdict."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from memplan.render import console
from memplan.units import format_bytes, format_seconds


def show_verify(result: Any) -> None:
    """Predicted against measured for one verify run (memplan.verify.VerifyResult)."""
    plan = result.plan
    table = Table(
        title=(
            f"verify: micro-batch {plan.micro_batch_size} × {plan.accumulation_steps}, "
            f"{len(plan.checkpoint_layers)} checkpointed · {result.device_name} · "
            f"{result.steps} step(s)"
        ),
        title_justify="left",
        header_style="bold",
    )
    for column in ("", "predicted", "measured", "error"):
        table.add_column(column, justify="left" if not column else "right")

    def err(value: float, limit: float | None) -> str:
        text = f"{value:+.1%}"
        if limit is None:
            return text
        return f"[green]{text}[/green]" if abs(value) <= limit else f"[red]{text}[/red]"

    table.add_row(
        "peak memory",
        format_bytes(result.predicted_peak_bytes),
        format_bytes(result.measured_peak_bytes),
        err(result.peak_error, result.tolerance),
    )
    if result.cuda_max_allocated_bytes is not None:
        reserve = plan.predicted.breakdown.reserve
        table.add_row(
            "  allocated (torch.cuda)",
            format_bytes(result.predicted_peak_bytes - reserve),
            format_bytes(result.cuda_max_allocated_bytes),
            "",
        )
        table.add_row(
            "  reserved (torch.cuda)", "", format_bytes(result.cuda_max_reserved_bytes or 0), ""
        )
    caveat = result.timing_caveat
    table.add_row(
        "time per optimizer step",
        format_seconds(result.predicted_step_seconds),
        format_seconds(result.measured_step_seconds) + ("" if result.steps < 2 else " (median)"),
        f"[dim]({result.time_error:+.0%})[/dim]" if caveat else err(result.time_error, None),
    )
    table.add_row(
        "budget",
        format_bytes(plan.budget_bytes),
        "",
        "[green]within[/green]" if result.within_budget else "[red]EXCEEDED[/red]",
    )
    table.add_row("effective batch", str(plan.target_batch), str(result.effective_batch), "")
    console.print(table)
    console.print(Text(_timing_line(result)))
    if result.note:
        console.print(Text(f"note: {result.note}"))
    _show_gradients(result)
    verdict = "[bold green]PASS[/bold green]" if result.passed else "[bold red]FAIL[/bold red]"
    console.print(Text.from_markup(verdict) + Text(_verdict_text(result, result.peak_error)))


def _timing_line(result: Any) -> str:
    """The measured steps' spread and the machine's load, and whether the time comparison
    means anything here."""
    samples = sorted(result.step_seconds_samples)
    parts = []
    if len(samples) >= 2:
        parts.append(
            f"{len(samples)} timed steps {format_seconds(samples[0])}–{format_seconds(samples[-1])}"
        )
    if result.load_average is not None:
        parts.append(f"load {result.load_average:.1f} on {result.cpu_count} core(s)")
    caveat = result.timing_caveat
    verdict = (
        f"the time comparison is not meaningful here: {caveat}"
        if caveat
        else "the time comparison stands"
    )
    return "step time: " + "; ".join([*parts, verdict])


def _verdict_text(result: Any, peak_error: float) -> str:
    failed = f" — {'; '.join(result.failures)}" if result.failures else ""
    return (
        f"{failed}: peak error {peak_error:+.1%} (tolerance ±{result.tolerance:.0%}), "
        f"measured peak {'within' if result.within_budget else 'over'} the budget."
    )


def _show_gradients(result: Any) -> None:
    """The plan check, then the batch coupling (a warning, never a failure)."""
    grad = result.gradient_check
    if grad.status == "skipped":
        console.print(Text(f"gradient check: skipped — {grad.reason}"))
    elif grad.status == "fail":
        console.print(
            Text("gradient check: ") + Text("fail", style="red") + Text(f" — {grad.failure_text}")
        )
    else:
        console.print(
            Text("gradient check: ")
            + Text("pass", style="green")
            + Text(
                f" — {grad.reason}: relative difference {grad.relative_error:.1e} "
                f"(tolerance {grad.tolerance:.0e})"
            )
        )
    couple = result.batch_coupling
    if couple.status == "equivalent":
        console.print(
            Text(
                f"batch coupling: equivalent — {couple.reason} give the same gradient "
                f"({couple.relative_error:.1e})"
            )
        )
    elif couple.status == "differs":
        console.print(
            Text("batch coupling: ")
            + Text("warning", style="yellow")
            + Text(
                f" — {couple.reason} differ by {couple.relative_error:.1e}: micro-batching "
                f"changes this loss's objective at effective batch {couple.effective_batch}. "
                f"Likely cause: {couple.cause}. The plan is not at fault; this does not fail it."
            )
        )
    else:
        console.print(Text(f"batch coupling: skipped — {couple.reason}"))


def show_distributed_verify(result: Any) -> None:
    """Per-rank predicted against measured (memplan.verify.DistributedVerifyResult)."""
    plan = result.plan
    table = Table(
        title=(
            f"verify: {plan.strategy}"
            + (f" · {plan.parallel.describe()}" if plan.parallel is not None else "")
            + f" on {result.world_size} ranks ({result.backend}, "
            f"{result.device}) · micro-batch {plan.micro_batch_size} × "
            f"{plan.accumulation_steps} · {len(plan.checkpoint_layers)} checkpointed"
        ),
        title_justify="left",
        header_style="bold",
    )
    for column in ("rank", "predicted peak", "measured peak", "error", "step time"):
        table.add_column(column, justify="right")
    for rank in result.ranks:
        error = result.rank_error(rank.rank)
        colour = "green" if abs(error) <= result.tolerance else "red"
        table.add_row(
            str(rank.rank),
            format_bytes(result.predicted_for_rank(rank.rank)),
            format_bytes(rank.peak_bytes),
            f"[{colour}]{error:+.2%}[/{colour}]",
            format_seconds(rank.step_seconds),
        )
    console.print(table)
    _show_gradients(result)
    verdict = "[bold green]PASS[/bold green]" if result.passed else "[bold red]FAIL[/bold red]"
    console.print(Text.from_markup(verdict) + Text(_verdict_text(result, result.peak_error)))
