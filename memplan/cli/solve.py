"""``memplan solve``: choose a plan for a profile and write it (and its ``--format`` files)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from memplan.cli.base import run_command
from memplan.cli.options import (
    FORMATS_HELP,
    BudgetOption,
    DeviceProfileOption,
    ForceOption,
    JsonOption,
    OutputOption,
    TargetBatchOption,
    WorldSizeOption,
    finite,
    split_names,
)
from memplan.devices import load_device, resolve_budget, spec_file_label
from memplan.emit.files import plan_targets
from memplan.errors import MemplanError, NoPlanFitsError
from memplan.files.schema import to_data
from memplan.memory import DEFAULT_MARGIN
from memplan.model.reference import given_model_note, located_model
from memplan.plan import plan_to_data
from memplan.profile import Profile, load_profile
from memplan.profile.seqlen import parse_seq_len
from memplan.units import parse_size

if TYPE_CHECKING:
    from memplan.solver import SolveResult
    from memplan.solver.compare import Comparison


@run_command
def solve(
    profile_path: Annotated[
        Path, typer.Argument(metavar="PROFILE", help="Profile YAML from `memplan probe`.")
    ],
    budget: BudgetOption,
    target_batch: TargetBatchOption = None,
    seq_len: Annotated[
        str | None,
        typer.Option(
            "--seq-len",
            help="Plan at this many tokens per sample, or max: the longest length (in steps of "
            "--seq-multiple) with a plan (profiles probed with --seq-lens).",
        ),
    ] = None,
    seq_multiple: Annotated[
        int, typer.Option("--seq-multiple", help="Step of --seq-len max, in tokens.")
    ] = 64,
    tokens_per_batch: Annotated[
        int | None,
        typer.Option(
            "--tokens-per-batch",
            help="Effective batch in tokens (packed samples of --seq-len tokens), instead of "
            "--target-batch.",
        ),
    ] = None,
    world_size: WorldSizeOption = 1,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel degree (fixed).")] = None,
    pp: Annotated[
        int | None, typer.Option("--pp", help="Pipeline-parallel degree (fixed).")
    ] = None,
    cp: Annotated[
        int | None,
        typer.Option("--cp", help="Context-parallel degree (modelled, not verified on CPU)."),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout",
            help="auto: search tp × pp × dp factorisations of --world-size (degrees given "
            "with --tp/--pp/--cp stay fixed).",
        ),
    ] = None,
    gpus_per_node: Annotated[
        int, typer.Option("--gpus-per-node", help="TP (× CP) stays within a node.")
    ] = 8,
    schedule: Annotated[
        str, typer.Option("--schedule", help="Pipeline schedule: gpipe, 1f1b, interleaved_1f1b.")
    ] = "1f1b",
    virtual_stages: Annotated[
        int, typer.Option("--virtual-stages", help="Stages per pipeline rank (interleaved).")
    ] = 1,
    stage_split: Annotated[
        str,
        typer.Option(
            "--stage-split",
            help="How the blocks divide into pipeline stages: memplan (its own: later stages "
            "take the extra blocks), torchtitan-2412 (torchtitan of December 2024) or "
            "torchtitan-2504 (torchtitan from April 2025 to 0.3).",
        ),
    ] = "memplan",
    fsdp_units: Annotated[
        str,
        typer.Option(
            "--fsdp-units",
            help="How FSDP groups the parameters outside the blocks: memplan (one root unit, "
            "whole all step: memplan's runtime, torchtitan of December 2024) or "
            "torchtitan-2507 (torchtitan from July 2025 to 0.3: the embeddings and the "
            "norm + head units of their own).",
        ),
    ] = "memplan",
    sequence_parallel: Annotated[
        bool | None,
        typer.Option(
            "--sequence-parallel/--no-sequence-parallel",
            help="Shard the norm/residual regions by sequence with TP (default: on with "
            "--layout auto, off with a fixed --tp).",
        ),
    ] = None,
    strategy: Annotated[
        str,
        typer.Option(
            help="ddp, zero1, zero2, fsdp, or auto (the least-sharded strategy that fits)."
        ),
    ] = "ddp",
    device_profile: DeviceProfileOption = None,
    margin: Annotated[
        float, typer.Option(help="Fraction of the budget kept free.")
    ] = DEFAULT_MARGIN,
    min_micro: Annotated[int, typer.Option("--min-micro")] = 1,
    max_micro: Annotated[int | None, typer.Option("--max-micro")] = None,
    always: Annotated[
        list[str] | None,
        typer.Option("--always-checkpoint", help="Layer names always checkpointed."),
    ] = None,
    never: Annotated[
        list[str] | None, typer.Option("--never-checkpoint", help="Layer names never checkpointed.")
    ] = None,
    bn_min_micro: Annotated[
        int, typer.Option("--bn-min-micro", help="Smallest micro-batch for BatchNorm models.")
    ] = 16,
    allow_small_bn_micro: Annotated[bool, typer.Option("--allow-small-bn-micro")] = False,
    modes: Annotated[
        str | None,
        typer.Option(
            "--modes",
            help="Per-layer modes to choose from, e.g. keep,full or "
            "keep,selective,full,offload (default: every mode the profile and device support).",
        ),
    ] = None,
    host_memory: Annotated[
        str | None,
        typer.Option("--host-memory", help="Host memory offloaded layers may take, e.g. 64GiB."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Model file to name in emitted configs (default: the profile's)."),
    ] = None,
    output: OutputOption = None,
    formats: Annotated[str | None, typer.Option("--format", help=FORMATS_HELP)] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out-dir", help="Folder for --format files (default: beside -o, else .)."),
    ] = None,
    force: ForceOption = False,
    as_json: JsonOption = False,
    compare: Annotated[
        list[Path] | None,
        typer.Option(
            "--compare",
            metavar="PROFILE",
            help="Another profile of the same model, probed another way (e.g. --precision "
            "float8 beside bf16): each is solved with this request, and the fastest that fits "
            "is the plan (ties: PROFILE). Repeatable.",
        ),
    ] = None,
) -> None:
    """Pick micro-batch × accumulation × checkpointed layers that fit the budget and run fastest."""
    from memplan import render
    from memplan.solver import SolveRequest, layout_request
    from memplan.solver import solve as run_solver
    from memplan.solver.compare import solve_compared

    comparison = None
    try:  # every refusal of an output or a request comes before anything is solved
        targets = plan_targets(
            output, formats, out_dir, force=force, inputs=[profile_path, *(compare or [])]
        )
        profile = load_profile(profile_path)
        others = _compared_profiles(profile_path, compare or [])
        spec = load_device(device_profile) if device_profile else None
        located, lost = located_model(profile.model.spec, profile.model.sha256, profile_path)
        if lost and not model:
            render.warn(lost)
        if model and (note := given_model_note(model, profile.model.sha256, profile.model.spec)):
            render.warn(note)
        request = SolveRequest(
            target_batch=target_batch,
            tokens_per_batch=tokens_per_batch,
            seq_len=None if seq_len is None else (parse_seq_len(seq_len) or "max"),
            seq_multiple=seq_multiple,
            layout=layout_request(
                layout,
                tp=tp,
                pp=pp,
                cp=cp,
                gpus_per_node=gpus_per_node,
                schedule=schedule,
                virtual_stages=virtual_stages,
                sequence_parallel=sequence_parallel,
                stage_split=stage_split,
                fsdp_units=fsdp_units,
            ),
            budget_bytes=resolve_budget(
                budget,  # type: ignore[arg-type]  # required
                device_spec=spec,
                probed_capacity_bytes=profile.environment.device_capacity_bytes,
            ),
            world_size=world_size,  # type: ignore[arg-type]  # default 1
            strategy=strategy,
            margin=finite(margin, "--margin", positive=False),
            min_micro=min_micro,
            max_micro=max_micro,
            always_checkpoint=split_names(always),
            never_checkpoint=split_names(never),
            bn_min_micro=bn_min_micro,
            allow_small_bn_micro=allow_small_bn_micro,
            device_spec=spec,
            device=spec_file_label(device_profile),
            model_path=model or located,
            profile_path=str(profile_path),
            modes=modes,
            host_memory_bytes=parse_size(host_memory, what="--host-memory")
            if host_memory
            else None,
        )
        with render.progress("memplan solve", quiet=as_json) as on_progress:
            on_progress(0, 0, f"{len(profile.layers):,} layers")
            if others:
                comparison = solve_compared([(str(profile_path), profile), *others], request)
                result = comparison.result
                if result is None:  # none fits: the main profile's error, as without --compare
                    raise comparison.rows[0].no_fit  # type: ignore[misc]  # set when no plan
            else:
                result = run_solver(profile, request)
    except NoPlanFitsError as exc:
        _show_no_fit(exc, request.budget_bytes, as_json=as_json, comparison=comparison)
        raise
    except MemplanError as exc:
        _show_refusal(exc, as_json=as_json)
        raise
    _show_result(result, as_json=as_json, comparison=comparison)
    _write(result.plan, targets, force=force)


def _compared_profiles(main: Path, paths: list[Path]) -> list[tuple[str, Profile]]:
    """The ``--compare`` profiles, read; a file named twice (or the main PROFILE again,
    however spelled) is refused before any is read."""
    from memplan.solver.compare import same_file_problem

    if problem := same_file_problem(str(main), [str(path) for path in paths]):
        raise problem
    return [(str(path), load_profile(path)) for path in paths]


def _write(plan, targets, *, force: bool) -> None:
    from memplan import render
    from memplan.emit.files import write_plan_files

    written = write_plan_files(plan, targets, force=force)
    for path in written.paths:
        render.info(f"wrote {path}")
    for path, note in written.notes:
        render.info(f"{path}: {note}")
    for _, exc in written.refused[:-1]:
        render.error(exc)
    if written.refused:
        raise written.refused[-1][1]


def _show_result(
    result: SolveResult, *, as_json: bool, comparison: Comparison | None = None
) -> None:
    from memplan import render
    from memplan.solver.compare import comparison_rows
    from memplan.units import format_bytes

    plan, seq = result.plan, result.seq
    compared = {"compared": comparison_rows(comparison)} if comparison else {}
    if as_json and result.layouts:
        rows = [
            {
                "parallel": to_data(o.parallel),
                "micro_batch": o.micro_batch,
                "micro_batches": o.micro_batches,
                "peak_bytes": o.peak_bytes,
                "stage_peak_bytes": [s.plan.predicted.peak_bytes for s in o.stages],
                "step_seconds": o.step_seconds,
                "bubble": o.bubble,
                "comm_seconds": o.comm_seconds,
            }
            for o in result.layouts
        ]
        render.print_json(
            {"feasible": True, "plan": plan_to_data(plan), "layouts": rows, **compared}
        )
    elif as_json:
        rows = [dict(to_data(cand)) for cand in result.candidates]
        extra = {"seq": to_data(dataclasses.replace(seq, result=None))} if seq else {}
        render.print_json(
            {"feasible": True, "plan": plan_to_data(plan), "candidates": rows, **extra, **compared}
        )
    else:
        render.show_plan(plan)
        if not result.layouts:
            render.show_candidates(
                [dict(to_data(c)) for c in result.candidates], plan.micro_batch_size
            )
        if seq is not None and seq.next_len is not None and seq.next_least_peak_bytes:
            render.info(
                f"seq_len {plan.seq_len} chosen; {seq.next_len} tokens has no plan: it needs "
                f"{format_bytes(seq.next_least_peak_bytes)} at the least"
            )
        if comparison is not None:
            from memplan.render.compare import show_comparison

            show_comparison(comparison)


def _show_refusal(exc: MemplanError, *, as_json: bool) -> None:
    """With --json, a refused request is one JSON object on stdout too (the message on
    stderr follows, as without --json)."""
    from memplan import render
    from memplan.errors import exit_code_of

    if as_json:
        render.print_json(
            {
                "feasible": False,
                "error": exc.message,
                "hint": exc.hint,
                "exit_code": exit_code_of(exc),
            }
        )


def _show_no_fit(
    exc: NoPlanFitsError,
    budget_bytes: int,
    *,
    as_json: bool,
    comparison: Comparison | None = None,
) -> None:
    from memplan import render
    from memplan.solver.compare import comparison_rows
    from memplan.units import format_bytes

    if as_json:
        render.print_json(
            {
                "feasible": False,
                "min_peak_bytes": exc.min_peak_bytes,
                "budget_bytes": budget_bytes,
                "message": str(exc),
                "closest": to_data(exc.closest) if exc.closest else None,
                **({"compared": comparison_rows(comparison)} if comparison else {}),
            }
        )
    elif exc.closest is not None:
        render.info(f"closest plan needs {format_bytes(exc.closest.predicted.peak_bytes)}:")
        # the error paragraph that follows says why it does not fit: not twice
        reasons = tuple(r for r in exc.closest.reasons if r not in str(exc))
        render.show_plan(dataclasses.replace(exc.closest, reasons=reasons))
    if comparison is not None and not as_json:
        from memplan.render.compare import show_comparison

        show_comparison(comparison)
