"""``memplan check`` and ``memplan init-check``: the CI memory-budget gate at the command line.

Thin, like the rest of the CLI: load memplan.yaml, call ``memplan.check.run_checks``, render
the report on stderr (``--json`` on stdout), write the JUnit file and the GitHub step
summary, and exit with ``CheckReport.exit_code``. ``register(app)`` adds both commands to
the typer app and may be called more than once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.errors import BadInputError


def check(
    config: Annotated[
        Path,
        typer.Option("--config", "-c", help="The checks file (paths in it are relative to it)."),
    ] = Path("memplan.yaml"),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON object on stdout.")
    ] = False,
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
    force: Annotated[bool, typer.Option(help="Overwrite an existing --junit file.")] = False,
) -> None:
    """CI gate: probe and solve every check in memplan.yaml; exit 1 if any is over budget.

    Exit codes: 0 all pass, 1 a check is over budget, 2 bad config, 3 cannot measure."""
    from memplan import render
    from memplan.check import append_step_summary, load_config, run_checks, to_json, to_junit_xml
    from memplan.fileio import write_text_atomic

    loaded = load_config(config)
    if junit is not None and junit.exists() and not force:
        write_text_atomic(junit, "", force=False)  # refuse now, not after minutes of probing
    names = [c.name for c in loaded.checks if not only or c.name in only]
    plots = _step_summary_plots()
    with render.progress("memplan check") as on_progress:
        done: list[str] = []

        def on_check(name: str, what: str) -> None:
            if name not in done:
                done.append(name)
            on_progress(len(done) - 1, len(names), f"{name}: {what}")
            if plots is not None:
                plots.on_check(name, what)

        extra = {"solve_fn": plots.solve} if plots is not None else {}
        report = run_checks(
            loaded, only=only, update_baseline=update_baseline, on_check=on_check, **extra
        )
    if as_json:
        render.stdout.out(to_json(report), highlight=False)
    else:
        show_report(report)
    if junit is not None:
        write_text_atomic(junit, to_junit_xml(report), force=True)
        render.info(f"wrote {junit}")
    summary = append_step_summary(report)
    if summary is not None and plots is not None:
        plots.append_to(summary)  # the report's PNG of each check, under its text
    if summary is not None and not as_json:
        render.info(f"appended a summary to {summary}")
    raise typer.Exit(report.exit_code)


def _step_summary_plots() -> Any:
    """memplan.report.CheckPlots when $GITHUB_STEP_SUMMARY is set and matplotlib is
    installed (the report extra), else None: the summary is then text only."""
    import os

    if not os.environ.get("GITHUB_STEP_SUMMARY"):
        return None
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return None
    from memplan.report import CheckPlots

    return CheckPlots()


def show_report(report: Any) -> None:
    """One row per check, then the details of every failure and error, on stderr."""
    from rich.table import Table
    from rich.text import Text

    from memplan import render
    from memplan.check import describe_growth, failure_text, plan_text
    from memplan.units import format_bytes

    table = Table(
        title=f"memplan check · {report.config}", title_justify="left", header_style="bold"
    )
    table.add_column("check", overflow="fold")
    table.add_column("result")
    for column in ("min peak", "budget", "headroom"):
        table.add_column(column, justify="right")
    table.add_column("plan", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    styles = {"pass": "bold green", "fail": "bold red", "error": "bold yellow"}
    for r in report.results:
        headroom = r.headroom_bytes
        if headroom is None:
            headroom_cell = Text("-")
        elif headroom >= 0:
            headroom_cell = Text(f"{format_bytes(headroom)} ({headroom / r.budget_bytes:.0%})")
        else:
            headroom_cell = Text(f"−{format_bytes(-headroom)}", style="red")
        table.add_row(
            r.name,
            Text(r.status.upper(), style=styles[r.status]),
            format_bytes(r.min_peak_bytes) if r.min_peak_bytes is not None else "-",
            format_bytes(r.budget_bytes),
            headroom_cell,
            plan_text(r.plan),
            f"{r.seconds:.1f} s",
        )
    render.console.print(table)
    for r in report.results:
        if r.status == "fail":
            render.console.print(Text(f"\n{r.name}: FAIL", style="bold red"))
            render.console.print(Text(failure_text(r)))
        elif r.status == "error":
            render.console.print(Text(f"\n{r.name}: could not check", style="bold yellow"))
            render.console.print(Text(r.message))
        else:
            grown = r.grown
            if grown:
                render.console.print(
                    Text(
                        f"{r.name}: grew since the baseline (still fits): "
                        + "; ".join(describe_growth(g) for g in grown[:3]),
                        style="dim",
                    )
                )
            if r.baseline_note:
                render.console.print(Text(f"{r.name}: {r.baseline_note}", style="dim"))
        if r.baseline_updated:
            render.console.print(Text(f"{r.name}: wrote baseline {r.baseline}", style="cyan"))
    passed = report.count("pass")
    render.console.print(
        Text(f"\n{passed}/{len(report.results)} checks pass", style="bold")
        + Text(
            "  (headroom: budget less margin, less the least peak any "
            "plan needs; plan: micro-batch×accumulation, checkpointed "
            "layers)",
            style="dim",
        )
    )


def init_check(
    model: Annotated[str, typer.Argument(help="Model file (model.py or model.py:factory).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write it.")] = Path(
        "memplan.yaml"
    ),
    budget: Annotated[
        str | None,
        typer.Option(
            help="Budget (24GiB, or 80% with --device-profile). Default: probe the "
            "model and allow 25% above its minimum peak."
        ),
    ] = None,
    target_batch: Annotated[int, typer.Option("--target-batch", help="Effective batch.")] = 32,
    device: Annotated[str, typer.Option(help="How CI probes: meta, cpu or cuda.")] = "meta",
    device_profile: Annotated[
        str | None, typer.Option("--device-profile", help="GPU spec, e.g. rtx4090.")
    ] = None,
    precision: Annotated[str, typer.Option(help="fp32, bf16 or fp16.")] = "fp32",
    name: Annotated[
        str | None, typer.Option(help="Check name (default: the model's stem).")
    ] = None,
    baseline: Annotated[
        str | None, typer.Option(help="Baseline profile path to record (relative to the output).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing output file.")] = False,
) -> None:
    """Write a starter memplan.yaml for `memplan check`."""
    from memplan import render
    from memplan.check import starter_config, suggest_budget
    from memplan.devices import load_device
    from memplan.fileio import write_text_atomic
    from memplan.loader import split_model_arg
    from memplan.units import format_bytes, parse_budget

    if device not in ("meta", "cpu", "cuda"):
        raise BadInputError(f"--device {device!r} is not one of meta, cpu, cuda.")
    if precision not in ("fp32", "bf16", "fp16"):
        raise BadInputError(f"--precision {precision!r} is not one of fp32, bf16, fp16.")
    if target_batch < 1:
        raise BadInputError(f"--target-batch must be >= 1, got {target_batch}.")
    path_text, factory = split_model_arg(model)
    model_path = Path(path_text)
    if not model_path.is_file():
        raise BadInputError(
            f"Model file {model_path} does not exist.",
            hint="Pass a Python file that defines build_model() and make_batch().",
        )
    if output.exists() and not force:
        write_text_atomic(output, "", force=False)  # raises OutputExistsError
    spec = load_device(device_profile) if device_profile else None
    if budget is None:
        with render.progress("probing for a starting budget"):
            budget, min_peak = suggest_budget(
                model,
                target_batch=target_batch,
                device=device,
                precision=precision,
                device_profile=device_profile,
            )
        render.info(
            f"minimum peak for batch {target_batch}: {format_bytes(min_peak)}; "
            f"budget {budget} leaves about 25% headroom"
        )
    else:
        parse_budget(budget, capacity_bytes=spec.memory_bytes if spec else None, what="--budget")
    relative = os.path.relpath(model_path.resolve(), output.resolve().parent)
    model_ref = Path(relative).as_posix() + ("" if factory == "build_model" else f":{factory}")
    text = starter_config(
        model=model_ref,
        name=name or model_path.stem,
        target_batch=target_batch,
        budget=budget,
        device=device,
        device_profile=device_profile,
        precision=precision,
        baseline=baseline,
    )
    write_text_atomic(output, text, force=force)
    then = f"memplan check --config {output}" + (" --update-baseline" if baseline else "")
    render.info(f"wrote {output}; next: `{then}`")


def register(app: typer.Typer) -> None:
    """Add ``check`` and ``init-check`` to ``app``; calling it again changes nothing."""
    from memplan.cli import _run

    registered = {
        info.name or getattr(info.callback, "__name__", "").replace("_", "-")
        for info in app.registered_commands
    }
    if "check" not in registered:
        app.command("check")(_run(check))
    if "init-check" not in registered:
        app.command("init-check")(_run(init_check))
