"""``memplan report``: draw where the peak is, from a plan or a profile."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memplan.cli.base import run_command
from memplan.cli.options import (
    BudgetOption,
    DeviceProfileOption,
    ForceOption,
    OutputOption,
    TargetBatchOption,
)


@run_command
def report(
    file: Annotated[Path, typer.Argument(metavar="PROFILE|PLAN", help="A plan or profile YAML.")],
    output: OutputOption,
    profile_path: Annotated[
        Path | None,
        typer.Option("--profile", help="The plan's profile, if not where the plan says."),
    ] = None,
    target_batch: TargetBatchOption = None,
    budget: BudgetOption = None,
    device_profile: DeviceProfileOption = None,
    force: ForceOption = False,
) -> None:
    """Draw where the peak is: predicted memory over one step, candidates, layer choices."""
    from memplan import render
    from memplan.files.io import refuse_existing
    from memplan.report import build_report, check_output, write_report
    from memplan.report.draw import matplotlib_pyplot
    from memplan.units import format_bytes

    check_output(output)
    refuse_existing(output, force=force)
    matplotlib_pyplot()  # a missing extra is an error before any work
    with render.progress("memplan report") as on_progress:
        on_progress(0, 2, "solving and laying out")
        result = build_report(
            file,
            profile_path=profile_path,
            target_batch=target_batch,
            budget=budget,
            device_profile=device_profile,
        )
        on_progress(1, 2, f"drawing {output.name}")
        size = write_report(result, output, force=force)
    for note in result.notes:
        render.warn(note)
    render.info(
        f"wrote {output} ({format_bytes(size)}): peak {format_bytes(result.timeline.peak_bytes)}"
        f" during {result.timeline.bars[result.timeline.peak_index].where}"
    )
