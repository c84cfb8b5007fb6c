"""``memplan solve``: choose a plan for a profile and write it (and its ``--format`` files)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from memplan.cli.base import run_command
from memplan.cli.options import FORMATS_HELP, finite, split_names
from memplan.files.schema import to_data
from memplan.memory import DEFAULT_MARGIN
from memplan.plan import plan_to_data

if TYPE_CHECKING:
    from memplan.errors import NoPlanFitsError
    from memplan.solver import SolveResult
    from memplan.solver.seqlen import SeqSolve


@run_command
def solve(
    profile_path: Annotated[
        Path, typer.Argument(metavar="PROFILE", help="Profile YAML from `memplan probe`.")
    ],
    budget: Annotated[
        str, typer.Option(help="24GiB, 512MiB, bytes, 80% (of device memory) or auto.")
    ],
    target_batch: Annotated[
        int | None, typer.Option("--target-batch", help="Effective batch size (samples).")
    ] = None,
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
    world_size: Annotated[
        int, typer.Option("--world-size", help="Ranks (all of them, with a layout).")
    ] = 1,
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
    device_profile: Annotated[
        str | None,
        typer.Option("--device-profile", help="GPU to plan for (see `memplan devices`)."),
    ] = None,
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
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write plan.yaml here.")
    ] = None,
    formats: Annotated[str | None, typer.Option("--format", help=FORMATS_HELP)] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out-dir", help="Folder for --format files (default: beside -o, else .)."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Overwrite existing output files.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print plan and candidates as JSON on stdout.")
    ] = False,
) -> None:
    """Pick micro-batch × accumulation × checkpointed layers that fit the budget and run fastest."""
    from memplan import render
    from memplan.devices import load_device, resolve_budget
    from memplan.emit.files import plan_targets
    from memplan.errors import BadInputError, NoPlanFitsError
    from memplan.profile import load_profile
    from memplan.profile.seqlen import parse_seq_len
    from memplan.solver import SolveRequest
    from memplan.solver import solve as run_solver
    from memplan.solver.seqlen import solve_seq
    from memplan.units import parse_size

    # Every refusal of an output comes before anything is solved or written.
    targets = plan_targets(output, formats, out_dir, force=force)
    finite(margin, "--margin", positive=False)
    length = parse_seq_len(seq_len) if seq_len is not None else None
    if (target_batch is None) == (tokens_per_batch is None):
        raise BadInputError(
            "Give the effective batch once: --target-batch (samples) or --tokens-per-batch "
            "(tokens, with --seq-len)."
        )
    profile = load_profile(profile_path)
    if tokens_per_batch is not None and seq_len is None:
        if profile.seq_len is None:
            raise BadInputError(
                "--tokens-per-batch needs the length of a sample: give --seq-len N or max."
            )
        length = profile.seq_len
    spec = load_device(device_profile) if device_profile else None
    request = SolveRequest(
        target_batch=target_batch or 1,  # with --tokens-per-batch, set per length
        budget_bytes=resolve_budget(
            budget,
            device_spec=spec,
            probed_capacity_bytes=profile.environment.device_capacity_bytes,
        ),
        world_size=world_size,
        strategy=strategy,
        margin=margin,
        min_micro=min_micro,
        max_micro=max_micro,
        always_checkpoint=split_names(always),
        never_checkpoint=split_names(never),
        bn_min_micro=bn_min_micro,
        allow_small_bn_micro=allow_small_bn_micro,
        device_spec=spec,
        model_path=model or profile.model.spec,
        profile_path=str(profile_path),
        modes=modes,
        host_memory_bytes=parse_size(host_memory, what="--host-memory") if host_memory else None,
    )
    ask = _layout_request(
        tp, pp, cp, layout, gpus_per_node, schedule, virtual_stages, sequence_parallel
    )
    seq = None
    if ask is not None:
        from memplan.solver.parallel import solve_layout

        if seq_len is not None or tokens_per_batch is not None:
            raise BadInputError(
                "--seq-len and --tokens-per-batch are not yet planned with a parallel layout.",
                hint="Probe at the length you train at and solve the layout without them.",
            )
        laid = solve_layout(profile, request, ask)
        _show_layout(laid, as_json=as_json)
        _write(laid.plan, targets, force=force)
        return
    try:
        with render.progress("memplan solve", quiet=as_json) as on_progress:
            on_progress(0, 0, f"{len(profile.layers):,} layers")
            if seq_len is None and tokens_per_batch is None:
                result = run_solver(profile, request)
            else:
                seq = solve_seq(
                    profile,
                    request,
                    length,
                    multiple=seq_multiple,
                    tokens_per_batch=tokens_per_batch,
                )
                result = seq.result
    except NoPlanFitsError as exc:
        _show_no_fit(exc, request.budget_bytes, as_json=as_json)
        raise
    _show_result(result, seq, as_json=as_json)
    _write(result.plan, targets, force=force)


def _layout_request(
    tp: int | None,
    pp: int | None,
    cp: int | None,
    layout: str | None,
    gpus_per_node: int,
    schedule: str,
    virtual_stages: int,
    sequence_parallel: bool | None,
):
    """The layout asked for, or None for data parallelism alone (no degree, no --layout)."""
    from memplan.errors import BadInputError
    from memplan.parallel import SCHEDULES
    from memplan.solver.parallel import LayoutRequest

    if layout is not None and layout != "auto":
        raise BadInputError(f"--layout takes auto, got {layout!r}.", hint="Use --layout auto.")
    if schedule not in SCHEDULES:
        raise BadInputError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}.")
    if layout is None and tp is None and pp is None and cp is None:
        return None
    return LayoutRequest(
        tp=tp,
        pp=pp,
        cp=cp,
        auto=layout == "auto",
        gpus_per_node=gpus_per_node,
        schedule=schedule,
        sequence_parallel=sequence_parallel,
        virtual_stages=virtual_stages,
    )


def _show_layout(laid, *, as_json: bool) -> None:
    from memplan import render

    plan = laid.plan
    if as_json:
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
            for o in laid.options
        ]
        render.print_json({"feasible": True, "plan": plan_to_data(plan), "layouts": rows})
        return
    render.show_plan(plan)


def _write(plan, targets, *, force: bool) -> None:
    from memplan import render
    from memplan.emit.files import write_plan_files

    written = write_plan_files(plan, targets, force=force)
    for path in written.paths:
        render.info(f"wrote {path}")
    for _, exc in written.refused[:-1]:
        render.error(exc)
    if written.refused:
        raise written.refused[-1][1]


def _show_result(result: SolveResult, seq: SeqSolve | None, *, as_json: bool) -> None:
    from memplan import render
    from memplan.units import format_bytes

    rows = [dict(to_data(cand)) for cand in result.candidates]
    plan = result.plan
    if as_json:
        extra = {"seq": to_data(dataclasses.replace(seq, result=None))} if seq else {}
        render.print_json(
            {"feasible": True, "plan": plan_to_data(plan), "candidates": rows, **extra}
        )
    else:
        render.show_plan(plan)
        render.show_candidates(rows, plan.micro_batch_size)
        if seq is not None and seq.next_len is not None and seq.next_least_peak_bytes:
            render.info(
                f"seq_len {plan.seq_len} chosen; {seq.next_len} tokens has no plan: it needs "
                f"{format_bytes(seq.next_least_peak_bytes)} at the least"
            )


def _show_no_fit(exc: NoPlanFitsError, budget_bytes: int, *, as_json: bool) -> None:
    from memplan import render
    from memplan.units import format_bytes

    if as_json:
        render.print_json(
            {
                "feasible": False,
                "min_peak_bytes": exc.min_peak_bytes,
                "budget_bytes": budget_bytes,
                "message": str(exc),
                "closest": to_data(exc.closest) if exc.closest else None,
            }
        )
    elif exc.closest is not None:
        render.info(f"closest plan needs {format_bytes(exc.closest.predicted.peak_bytes)}:")
        # the error paragraph that follows says why it does not fit: not twice
        reasons = tuple(r for r in exc.closest.reasons if r not in str(exc))
        render.show_plan(dataclasses.replace(exc.closest, reasons=reasons))
