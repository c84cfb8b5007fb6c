"""``memplan verify``: run a plan for real (one process, or one per rank) and compare
measured with predicted memory and time; ``--report`` also draws measured over predicted."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from memplan.cli.base import run_command
from memplan.cli.options import (
    ForceOption,
    JsonOption,
    LoraOption,
    SeqLenOption,
    TaskOption,
    WorldSizeOption,
    finite,
    running_user_code,
)
from memplan.errors import BadInputError
from memplan.model.reference import planned_model_reference

if TYPE_CHECKING:
    from memplan.profile import Profile
    from memplan.verify import DistributedVerifyResult, VerifyResult


@run_command
def verify(
    first: Annotated[
        str,
        typer.Argument(
            metavar="MODEL_OR_PLAN",
            help="The plan (plan.yaml from `memplan solve`): the model is the one it records. "
            "Or the model (model.py, model.py:factory or hf:PATH_OR_ID), then the plan.",
            show_default=False,
        ),
    ],
    second: Annotated[
        str | None,
        typer.Argument(metavar="PLAN", help="The plan, after a model.", show_default=False),
    ] = None,
    task: TaskOption = None,
    seq_len: SeqLenOption = None,
    lora: LoraOption = None,
    steps: Annotated[
        int, typer.Option(help="Optimizer steps to measure (and as many to time).")
    ] = 3,
    device: Annotated[
        str | None, typer.Option(help="cpu or cuda (default: the plan's device).")
    ] = None,
    tolerance: Annotated[float, typer.Option(help="Largest |peak error| that passes.")] = 0.05,
    world_size: WorldSizeOption = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds the multi-process run may take before it is killed.")
    ] = 300.0,
    grad_check: Annotated[
        bool,
        typer.Option(
            "--grad-check/--no-grad-check",
            help="Compare the plan's gradients with the textbook run's, and micro-batches "
            "with one batch of the effective size.",
        ),
    ] = True,
    as_json: JsonOption = False,
    report_path: Annotated[
        Path | None,
        typer.Option("--report", help="Also write report.html/.png: measured over predicted."),
    ] = None,
    force: ForceOption = False,
) -> None:
    """Run the plan for real and compare measured with predicted memory and time."""
    from memplan import render
    from memplan.plan import load_plan
    from memplan.render.verify import show_distributed_verify, show_verify
    from memplan.verify import run_verify

    _check_options(world_size, steps, tolerance, timeout, device)
    given, plan_path = (first, Path(second)) if second is not None else (None, Path(first))
    plan = load_plan(plan_path)
    if report_path is not None:
        _check_report_path(report_path, force)
    model = planned_model_reference(
        given, plan.model, plan_path.parent, task=task, seq_len=seq_len, lora=lora
    )
    distributed = (world_size or plan.world_size) > 1
    with (
        running_user_code(model, as_json=as_json),
        render.progress(
            "verifying on several ranks" if distributed else "verifying", quiet=as_json
        ) as tick,
    ):
        result = run_verify(
            model,
            plan,
            world_size=world_size,
            steps=steps,
            device=device,
            tolerance=tolerance,
            check_gradients=grad_check,
            timeout_s=timeout,
            on_progress=tick,
            record_timeline=report_path is not None,
        )
    if as_json:
        render.print_json(result.json_data())
    elif distributed:
        show_distributed_verify(result)
    else:
        show_verify(result)
    from memplan.report import plan_profile, stale_plan_note

    profile_at = plan_profile(plan, plan_path)
    for note in (
        _changed_since_probe(profile_at, model),
        stale_plan_note(plan, plan_path, profile_at),
    ):
        if note:
            render.warn(note)
    _write_verify_report(result, plan_path, report_path, force)
    if not result.passed:
        raise typer.Exit(1)


def _check_options(
    world_size: int | None, steps: int, tolerance: float, timeout: float, device: str | None
) -> None:
    if world_size is not None and world_size < 1:
        raise BadInputError(f"--world-size {world_size} must be at least 1.")
    if steps < 1:
        raise BadInputError(f"--steps {steps} must be at least 1.")
    finite(tolerance, "--tolerance", positive=False)
    finite(timeout, "--timeout", positive=True)
    most = 7 * 24 * 3600  # verify.rank_lifetime.MAX_TIMEOUT_S, without importing torch here
    if timeout > most:  # (before: 1e10 s, gloo's DistNetworkError; 1e15 s, OverflowError)
        raise BadInputError(
            f"--timeout {timeout:g} is more than verify takes: at most {most} s (7 days).",
            hint=f"Give --timeout in seconds, up to {most}.",
        )
    if device is not None and device not in ("cpu", "cuda"):
        raise BadInputError(
            f"--device {device!r}: verify runs on cpu or cuda.",
            hint="Choose --device cpu or --device cuda (pick a GPU with CUDA_VISIBLE_DEVICES=N).",
        )


def _changed_since_probe(profile_at: tuple[Path, Profile] | None, model: str) -> str:
    """A warning when the model file's bytes are not those the plan's profile
    (``report.plan_profile``) recorded: a verdict on an edited file read as memplan's
    misprediction (a head that concatenated its logits: "-39.2%", nothing said of the
    edit). '' when they match, or when the profile or the file cannot be found (nothing to
    compare)."""
    import hashlib

    from memplan.model.reference import split_model_arg

    if profile_at is None:
        return ""
    recorded = profile_at[1].model.sha256
    file = Path(split_model_arg(model)[0])
    try:
        now = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else ""
    except OSError:
        return ""
    if not recorded or not now or now == recorded:
        return ""
    return (
        f"{file} changed since it was probed for this plan (sha256 {recorded[:12]}… then, "
        f"{now[:12]}… now): a difference above may be that change, not memplan's "
        "prediction. Probe and solve again to verify the file as it is."
    )


def _check_report_path(path: Path, force: bool) -> None:
    """Refuse a bad --report path, or an existing one without --force (verify had no
    --force, and the hint asked for it and for -o), or a missing matplotlib, before
    running."""
    from memplan.files.io import refuse_existing
    from memplan.report import check_output
    from memplan.report.draw import matplotlib_pyplot

    check_output(path, "--report")
    refuse_existing(path, force=force, option="--report")
    matplotlib_pyplot()


def _write_verify_report(
    result: VerifyResult | DistributedVerifyResult,
    plan_path: Path | None,
    path: Path | None,
    force: bool,
) -> None:
    if path is None or plan_path is None:
        return
    from memplan import render
    from memplan.report import write_verify_report
    from memplan.units import format_bytes

    size = write_verify_report(result, plan_path, path, force=force)
    render.info(f"wrote {path} ({format_bytes(size)})")
