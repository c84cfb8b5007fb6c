"""``memplan check`` and ``memplan init-check``: the CI memory-budget gate at the command line.

Thin: each command parses its options, calls one library function (``memplan.check``),
renders the result (``memplan.render.check``; ``--json`` on stdout), writes the JUnit file
and the GitHub step summary, and exits with ``CheckReport.exit_code``. ``register(app)``
adds both commands to the typer app (``memplan.cli`` calls it) and may be called more than
once.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from memplan.check.config import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S
from memplan.cli.base import run_command
from memplan.cli.options import (
    BudgetOption,
    DeviceProfileOption,
    ForceOption,
    JsonOption,
    OutputOption,
    TargetBatchOption,
)

if TYPE_CHECKING:
    from memplan.report import CheckPlots


def check(
    config: Annotated[
        Path,
        typer.Option("--config", "-c", help="The checks file (paths in it are relative to it)."),
    ] = Path("memplan.yaml"),
    as_json: JsonOption = False,
    junit: Annotated[
        Path | None,
        typer.Option("--junit", help="Write a JUnit XML report (one testcase per check)."),
    ] = None,
    update_baseline: Annotated[
        bool, typer.Option("--update-baseline", help="Rewrite each check's baseline profile.")
    ] = False,
    only: Annotated[
        list[str] | None,
        typer.Option("--only", help="Run only the check with this name (repeatable)."),
    ] = None,
    force: ForceOption = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            help="Seconds each check's probe may take (a check's own timeout: wins); "
            "over it, the check is an error naming where it was. 0: no limit.",
        ),
    ] = DEFAULT_TIMEOUT_S,
) -> None:
    """CI gate: probe and solve every check in memplan.yaml; exit 1 if any is over budget.

    Exit codes: 0 all pass, 1 a check is over budget (whatever else happened), else 2 a bad
    config or a model that cannot be loaded or run, else 3 cannot measure (docs/ci.md).
    On SIGINT/SIGTERM the finished checks' results are still written; exit 128 + N."""
    from memplan import render
    from memplan.check import append_step_summary, load_config, run_checks, to_json, to_junit_xml
    from memplan.errors import BadInputError, Interrupted
    from memplan.files.io import check_output, write_text_atomic
    from memplan.render.check import check_progress, show_report

    if not 0 <= timeout <= MAX_TIMEOUT_S:  # NaN fails too
        raise BadInputError(
            f"--timeout {timeout}: give seconds from 0 (no limit) to {MAX_TIMEOUT_S:g}."
        )
    loaded = load_config(config)
    if junit is not None:
        check_output(junit, force=force)  # now, not after minutes of probing
    plots = _step_summary_plots()
    with check_progress(loaded, only, quiet=as_json) as on_check:
        report = run_checks(
            loaded,
            only=only,
            update_baseline=update_baseline,
            on_check=on_check,
            on_plan=plots.keep if plots is not None else None,
            timeout_s=timeout or None,
        )
    if as_json:
        render.stdout.out(to_json(report), highlight=False)
    else:
        show_report(report)
    summary = append_step_summary(report)  # first: it never refuses to write
    if summary is not None and plots is not None and report.interrupted is None:
        plots.append_to(summary)  # the report's PNG of each check, under its text
    if summary is not None and not as_json:
        render.info(f"appended a summary to {summary}")
    if junit is not None:  # no clobber: a file that appeared while the checks ran is kept
        write_text_atomic(junit, to_junit_xml(report), force=force)
        render.info(f"wrote {junit}")
    if report.interrupted is not None:
        raise Interrupted(report.interrupted)  # the console script exits 128 + N
    raise typer.Exit(report.exit_code)


def _step_summary_plots() -> CheckPlots | None:
    """memplan.report.CheckPlots when $GITHUB_STEP_SUMMARY is set and matplotlib is
    installed (the report extra), else None: the summary is then text only."""
    if not os.environ.get("GITHUB_STEP_SUMMARY") or importlib.util.find_spec("matplotlib") is None:
        return None
    from memplan.report import CheckPlots

    return CheckPlots()


def init_check(
    model: Annotated[str, typer.Argument(help="Model file (model.py or model.py:factory).")],
    output: OutputOption = Path("memplan.yaml"),
    budget: BudgetOption = None,
    target_batch: TargetBatchOption = 32,
    device: Annotated[str, typer.Option(help="How CI probes: meta, cpu or cuda.")] = "meta",
    device_profile: DeviceProfileOption = None,
    precision: Annotated[str, typer.Option(help="fp32, bf16 or fp16.")] = "fp32",
    name: Annotated[
        str | None, typer.Option(help="Check name (default: the model's stem).")
    ] = None,
    baseline: Annotated[
        str | None, typer.Option(help="Baseline profile path to record (relative to the output).")
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(help="Checkpoint candidates: comma-separated globs of module names."),
    ] = None,
    force: ForceOption = False,
) -> None:
    """Write a starter memplan.yaml for `memplan check`.

    Without --budget it probes the model and allows 25% above its minimum peak."""
    from memplan import render
    from memplan.check import make_starter
    from memplan.files.io import check_output, write_text_atomic
    from memplan.units import format_bytes

    check_output(output, force=force)
    with render.progress("writing a starter config (probing when no --budget)"):
        starter = make_starter(
            model,
            output=output,
            budget=budget,
            target_batch=target_batch,
            device=device,
            device_profile=device_profile,
            precision=precision,
            name=name,
            baseline=baseline,
            layers=layers,
        )
    if starter.min_peak_bytes is not None:
        render.info(
            f"minimum peak for batch {target_batch}: {format_bytes(starter.min_peak_bytes)}; "
            f"budget {starter.budget} leaves about 25% headroom"
        )
    write_text_atomic(output, starter.text, force=force)
    render.info(f"wrote {output}; next: `{starter.then}`")


def register(app: typer.Typer) -> None:
    """Add ``check`` and ``init-check`` to ``app``; calling it again changes nothing."""
    registered = {
        info.name or getattr(info.callback, "__name__", "").replace("_", "-")
        for info in app.registered_commands
    }
    if "check" not in registered:
        app.command("check")(run_command(check))
    if "init-check" not in registered:
        app.command("init-check")(run_command(init_check))
