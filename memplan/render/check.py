"""``memplan check``'s report on the terminal: one row per check, then the details of every
failure and error, on stderr. Text only from the report (``memplan.check.advice``'s words);
every name is wrapped in ``Text``, so rich markup in a check name is shown, not obeyed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from rich.table import Table
from rich.text import Text

from memplan.check.advice import describe_growth, failure_text, plan_text
from memplan.check.config import CheckConfig
from memplan.check.result import CheckReport
from memplan.render import console, progress
from memplan.units import format_bytes

_STYLES = {"pass": "bold green", "fail": "bold red", "error": "bold yellow"}


def report_table(report: CheckReport) -> Table:
    table = Table(
        title=Text(f"memplan check · {report.config}"), title_justify="left", header_style="bold"
    )
    table.add_column("check", overflow="fold")
    table.add_column("result")
    for column in ("min peak", "budget", "headroom"):
        table.add_column(column, justify="right")
    table.add_column("plan", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    for r in report.results:
        headroom = r.headroom_bytes
        if headroom is None:
            headroom_cell = Text("-")
        elif headroom >= 0:
            headroom_cell = Text(f"{format_bytes(headroom)} ({headroom / r.budget_bytes:.0%})")
        else:
            headroom_cell = Text(f"−{format_bytes(-headroom)}", style="red")
        table.add_row(
            Text(r.name),
            Text(r.status.upper(), style=_STYLES[r.status]),
            format_bytes(r.min_peak_bytes) if r.min_peak_bytes is not None else "-",
            format_bytes(r.budget_bytes),
            headroom_cell,
            plan_text(r.plan),
            f"{r.seconds:.1f} s",
        )
    return table


def show_report(report: CheckReport) -> None:
    """The table, then each failure's and error's paragraph, then the count."""
    console.print(report_table(report))
    for r in report.results:
        if r.status == "fail":
            console.print(Text(f"\n{r.name}: FAIL", style="bold red"))
            console.print(Text(failure_text(r)))
        elif r.status == "error":
            console.print(Text(f"\n{r.name}: could not check", style="bold yellow"))
            console.print(Text(r.message))
        else:
            grown = r.grown
            if grown:
                console.print(
                    Text(
                        f"{r.name}: grew since the baseline (still fits): "
                        + "; ".join(describe_growth(g) for g in grown[:3]),
                        style="dim",
                    )
                )
            if r.baseline_note:
                console.print(Text(f"{r.name}: {r.baseline_note}", style="dim"))
        if r.baseline_updated:
            console.print(Text(f"{r.name}: wrote baseline {r.baseline}", style="cyan"))
    passed = report.count("pass")
    console.print(
        Text(f"\n{passed}/{len(report.results)} checks pass", style="bold")
        + Text(
            "  (headroom: budget less margin, less the least peak any "
            "plan needs; plan: micro-batch×accumulation, checkpointed "
            "layers)",
            style="dim",
        )
    )


@contextlib.contextmanager
def check_progress(
    config: CheckConfig,
    only: Sequence[str] | None,
    *,
    quiet: bool = False,
) -> Iterator[Callable[[str, str], None]]:
    """A progress bar over the selected checks, driven by ``run_checks``'s ``on_check``;
    silent with ``quiet`` (``--json``)."""
    total = sum(1 for c in config.checks if not only or c.name in only)
    with progress("memplan check", quiet=quiet) as on_progress:
        done: list[str] = []

        def on_check(name: str, what: str) -> None:
            if name not in done:
                done.append(name)
            on_progress(len(done) - 1, total, f"{name}: {what}")

        yield on_check
