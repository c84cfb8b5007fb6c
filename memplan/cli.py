"""The ``memplan`` command line: each command loads its input, calls one library function
and renders the result. Domain errors become one paragraph on stderr and an exit code here,
in one place (``memplan.cli_base.run_command``, imported here as ``_run``)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan import __version__, cli_check
from memplan.cli_base import run_command as _run
from memplan.cli_base import state as _state
from memplan.emit import FORMATS
from memplan.errors import BadInputError, Interrupted
from memplan.loader import model_reference
from memplan.memory import DEFAULT_MARGIN
from memplan.schema import load_yaml_file, to_data

app = typer.Typer(
    name="memplan",
    help="Memory planner for PyTorch training: measure a model, pick micro-batch × "
    "accumulation × checkpointed layers that fit a budget, prove it with a real run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

FORMATS_HELP = f"Comma-separated: {', '.join(FORMATS)}."


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memplan {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print version.")
    ] = False,
) -> None:
    _state["debug"] = debug


@contextlib.contextmanager
def _running_user_code(model: str, *, as_json: bool) -> Iterator[None]:
    """Around a call that runs the model file: its exits become a clean error
    (``loader.contain_exits``), and with ``--json`` whatever it prints goes to stderr —
    Python's ``print`` and writes to file descriptor 1 by native code or child processes —
    so stdout stays one JSON object."""
    from memplan.loader import contain_exits

    with contextlib.ExitStack() as stack:
        stack.enter_context(contain_exits(model))
        if as_json:
            stack.enter_context(contextlib.redirect_stdout(sys.stderr))
            stack.enter_context(_fd1_to_stderr())
        yield


@contextlib.contextmanager
def _fd1_to_stderr() -> Iterator[None]:
    try:
        sys.__stdout__.flush()  # type: ignore[union-attr]
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, AttributeError, ValueError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.__stderr__.flush()  # type: ignore[union-attr]
        os.dup2(saved, 1)
        os.close(saved)


def _finite(value: float, flag: str, *, positive: bool) -> float:
    """``value`` if finite and > 0 (``positive``) or >= 0, else exit 2 naming ``flag``."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "a positive" if positive else "a non-negative"
        raise BadInputError(f"{flag} {value} must be {need} finite number.")
    return value


def _parse_micro_batches(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or sizes[0] < 1:
        raise BadInputError(
            f"--micro-batches {text!r} must list at least two distinct positive sizes.",
            hint="For example --micro-batches 1,2,4 (affine fits need two points; three "
            "also give a residual).",
        )
    return sizes


# ---------------------------------------------------------------------------- probe
@app.command()
@_run
def probe(
    model: Annotated[
        str,
        typer.Argument(
            help="Model file (model.py or model.py:factory), or hf:PATH_OR_ID (a Hugging "
            "Face config; with --task and --seq-len)."
        ),
    ],
    task: Annotated[
        str | None,
        typer.Option(help="hf: references: causal-lm, seq2seq-lm, seq-cls or masked-lm."),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="hf: references: tokens per sample.")
    ] = None,
    lora: Annotated[
        str | None,
        typer.Option(help="hf: references: peft LoRA, e.g. r=16,alpha=32,targets=q_proj,v_proj."),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or meta.")] = "auto",
    micro_batches: Annotated[
        str, typer.Option("--micro-batches", help="Sizes to measure, e.g. 1,2,4.")
    ] = "1,2,4",
    precision: Annotated[str, typer.Option(help="fp32, bf16 or fp16 (autocast).")] = "fp32",
    mixed_precision: Annotated[
        str,
        typer.Option(
            "--mixed-precision",
            help="autocast (single device, DDP) or params: parameters in --precision, as "
            "FSDP's mixed-precision policy trains (for --strategy fsdp plans).",
        ),
    ] = "autocast",
    layers: Annotated[
        str | None, typer.Option(help="Glob of checkpoint candidates, e.g. 'transformer.h.*'.")
    ] = None,
    device_profile: Annotated[
        str | None,
        typer.Option("--device-profile", help="GPU spec to time a meta probe against."),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the profile YAML.")
    ] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing output file.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the profile as JSON on stdout.")
    ] = False,
) -> None:
    """Measure a model per layer (memory and time) and write a profile."""
    from memplan import render
    from memplan.fileio import check_output, write_text_atomic
    from memplan.probe import probe_model
    from memplan.profile import profile_to_yaml

    if device not in ("auto", "cpu", "cuda", "meta"):
        raise BadInputError(f"--device {device!r} is not one of auto, cpu, cuda, meta.")
    if precision not in ("fp32", "bf16", "fp16"):
        raise BadInputError(f"--precision {precision!r} is not one of fp32, bf16, fp16.")
    sizes = _parse_micro_batches(micro_batches)
    if output is not None:
        check_output(output, force=force)  # refuse before minutes of probing, not after
    model = model_reference(model, task=task, seq_len=seq_len, lora=lora)
    with _running_user_code(model, as_json=as_json), render.progress("probing") as on_progress:
        profile = probe_model(
            model,
            device=device,
            micro_batches=sizes,
            precision=precision,
            layers=layers,
            device_profile=device_profile,
            on_progress=on_progress,
            mixed_precision=mixed_precision,
        )
    if as_json:
        render.print_json(to_data(profile))
    else:
        render.show_profile(profile)
        if profile.deduplicated_layers:
            render.info(
                f"{len(profile.deduplicated_layers)} of {len(profile.layers)} layers are "
                "identical to an earlier one and reused its meta measurements"
            )
    if output is not None:
        write_text_atomic(output, profile_to_yaml(profile), force=force)
        render.info(f"wrote {output}")


# ---------------------------------------------------------------------------- show
@app.command()
@_run
def show(
    file: Annotated[Path, typer.Argument(help="A profile or plan YAML.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON on stdout.")] = False,
) -> None:
    """Render a profile or plan file again."""
    from memplan import render
    from memplan.plan import plan_from_data
    from memplan.profile import profile_from_data

    data = load_yaml_file(file, what="profile or plan")
    obj = (
        plan_from_data(data, source=str(file))
        if "target_batch" in data
        else profile_from_data(data, source=str(file))
    )
    if as_json:
        render.print_json(to_data(obj))
    elif "target_batch" in data:
        render.show_plan(obj)
    else:
        render.show_profile(obj)


# ---------------------------------------------------------------------------- solve
def _split_names(values: list[str] | None) -> tuple[str, ...]:
    return tuple(n.strip() for v in values or [] for n in v.split(",") if n.strip())


@app.command()
@_run
def solve(
    profile_path: Annotated[
        Path, typer.Argument(metavar="PROFILE", help="Profile YAML from `memplan probe`.")
    ],
    target_batch: Annotated[int, typer.Option("--target-batch", help="Effective batch size.")],
    budget: Annotated[
        str, typer.Option(help="24GiB, 512MiB, bytes, 80% (of device memory) or auto.")
    ],
    world_size: Annotated[int, typer.Option("--world-size", help="Data-parallel ranks.")] = 1,
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
    from memplan.devices import load_device, local_gpu
    from memplan.emit import FORMATS, emit_all
    from memplan.errors import NoPlanFitsError
    from memplan.fileio import check_outputs, write_outputs
    from memplan.loader import relative_reference
    from memplan.plan import plan_to_yaml
    from memplan.profile import load_profile
    from memplan.solver import SolveRequest
    from memplan.solver import solve as run_solver
    from memplan.units import format_bytes, parse_budget, parse_size

    wanted = [f.strip() for f in (formats or "").split(",") if f.strip()]
    unknown = [f for f in wanted if f not in FORMATS]
    if unknown:
        raise BadInputError(
            f"--format {', '.join(unknown)} is not a known format.",
            hint=f"Known formats: {', '.join(FORMATS)}.",
        )
    folder = out_dir or (output.parent if output is not None else Path("."))
    targets: list[tuple[Path, str | None]] = [] if output is None else [(output, None)]
    targets += [
        (folder / FORMATS[fmt].filename, fmt)
        for fmt in wanted
        if not (fmt == "plan" and output is not None)
    ]
    # Every refusal (exists, not a regular file, unwritable, the same file twice) comes
    # before anything is solved or written.
    check_outputs((path for path, _ in targets), force=force)
    _finite(margin, "--margin", positive=False)
    profile = load_profile(profile_path)
    spec = load_device(device_profile) if device_profile else None
    capacity = spec.memory_bytes if spec else profile.environment.device_capacity_bytes
    free = None
    if budget.strip().lower() == "auto":
        gpu = local_gpu()
        free = gpu.free_bytes if gpu else None
        capacity = capacity or (gpu.total_bytes if gpu else None)
    budget_bytes = parse_budget(budget, capacity_bytes=capacity, free_bytes=free)
    request = SolveRequest(
        target_batch=target_batch,
        budget_bytes=budget_bytes,
        world_size=world_size,
        strategy=strategy,
        margin=margin,
        min_micro=min_micro,
        max_micro=max_micro,
        always_checkpoint=_split_names(always),
        never_checkpoint=_split_names(never),
        bn_min_micro=bn_min_micro,
        allow_small_bn_micro=allow_small_bn_micro,
        device_spec=spec,
        model_path=model or _model_ref(profile),
        profile_path=str(profile_path),
        modes=modes,
        host_memory_bytes=parse_size(host_memory, what="--host-memory") if host_memory else None,
    )
    try:
        result = run_solver(profile, request)
    except NoPlanFitsError as exc:
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
        if exc.closest is not None and not as_json:
            render.info(f"closest plan needs {format_bytes(exc.closest.predicted.peak_bytes)}:")
            render.show_plan(exc.closest)
        raise
    plan = result.plan
    rows = _candidate_rows(result)
    if as_json:
        render.print_json({"feasible": True, "plan": to_data(plan), "candidates": rows})
    else:
        render.show_plan(plan)
        render.show_candidates(rows, plan.micro_batch_size)

    # Scripts resolve a relative model path against their own folder; a format that cannot
    # write the plan's strategy is refused without stopping the others.
    emitted = emit_all(
        plan,
        [fmt for _, fmt in targets if fmt is not None],
        model_path=relative_reference(plan.model, folder),
    )
    texts = {fmt: text for fmt, _, text in emitted.files}
    outputs = [
        (path, plan_to_yaml(plan) if fmt is None else texts[fmt])
        for path, fmt in targets
        if fmt is None or fmt in texts
    ]
    for path in write_outputs(outputs, force=force):
        render.info(f"wrote {path}")
    if emitted.refused:
        for _, exc in emitted.refused[:-1]:
            render.error(exc)
        raise emitted.refused[-1][1]


def _model_ref(profile: Any) -> str:
    return profile.model.spec


def _candidate_rows(result: Any) -> list[dict[str, Any]]:
    rows = []
    for cand in result.candidates:
        data = to_data(cand)
        rows.append(data if isinstance(data, dict) else dict(data))
    return rows


# ---------------------------------------------------------------------------- verify
@app.command()
@_run
def verify(
    model: Annotated[
        str,
        typer.Argument(
            help="Model file (model.py or model.py:factory), or hf:PATH_OR_ID (a Hugging "
            "Face config; with --task and --seq-len)."
        ),
    ],
    plan_path: Annotated[
        Path, typer.Argument(metavar="PLAN", help="plan.yaml from `memplan solve`.")
    ],
    task: Annotated[
        str | None,
        typer.Option(help="hf: references: causal-lm, seq2seq-lm, seq-cls or masked-lm."),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="hf: references: tokens per sample.")
    ] = None,
    lora: Annotated[
        str | None,
        typer.Option(help="hf: references: peft LoRA, e.g. r=16,alpha=32,targets=q_proj,v_proj."),
    ] = None,
    steps: Annotated[
        int, typer.Option(help="Optimizer steps to measure (and as many to time).")
    ] = 3,
    device: Annotated[
        str | None, typer.Option(help="cpu or cuda (default: the plan's device).")
    ] = None,
    tolerance: Annotated[float, typer.Option(help="Largest |peak error| that passes.")] = 0.05,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            help="Ranks to run (default: the plan's); more than 1 starts real processes.",
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds the multi-process run may take before it is killed.")
    ] = 300.0,
    grad_check: Annotated[
        bool,
        typer.Option(
            "--grad-check/--no-grad-check", help="Compare accumulated and full-batch gradients."
        ),
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the result as JSON on stdout.")
    ] = False,
    report_path: Annotated[
        Path | None,
        typer.Option("--report", help="Also write report.html/.png: measured over predicted."),
    ] = None,
) -> None:
    """Run the plan for real and compare measured with predicted memory and time."""
    from memplan import render
    from memplan.plan import load_plan
    from memplan.verify import verify_plan

    if world_size is not None and world_size < 1:
        raise BadInputError(f"--world-size {world_size} must be at least 1.")
    if steps < 1:
        raise BadInputError(f"--steps {steps} must be at least 1.")
    _finite(tolerance, "--tolerance", positive=False)
    _finite(timeout, "--timeout", positive=True)
    if device is not None and device not in ("cpu", "cuda"):
        raise BadInputError(
            f"--device {device!r}: verify runs on cpu or cuda.",
            hint="Choose --device cpu or --device cuda (pick a GPU with CUDA_VISIBLE_DEVICES=N).",
        )
    plan = load_plan(plan_path)
    if report_path is not None:
        _check_report_path(report_path)
    model = model_reference(model, task=task, seq_len=seq_len, lora=lora)
    if (world_size or plan.world_size) > 1:
        with _running_user_code(model, as_json=as_json):
            _verify_distributed(
                model,
                plan,
                world_size,
                steps,
                device,
                tolerance,
                grad_check,
                timeout,
                as_json,
                report_path,
                plan_path,
            )
        return
    with (
        _running_user_code(model, as_json=as_json),
        render.progress("verifying") as on_progress,
    ):
        result = verify_plan(
            model,
            plan,
            steps=steps,
            device=device,
            tolerance=tolerance,
            check_gradients=grad_check,
            on_progress=on_progress,
            record_timeline=report_path is not None,
        )
    if as_json:
        data = to_data(result)
        data.pop("timeline", None)  # per-op bytes are for --report, not the JSON
        data.update(
            peak_error=result.peak_error,
            time_error=result.time_error,
            within_budget=result.within_budget,
            passed=result.passed,
            failures=result.failures,
        )
        render.print_json(data)
    else:
        render.show_verify(result)
    _write_verify_report(result, plan_path, report_path)
    if not result.passed:
        raise typer.Exit(1)


def _verify_distributed(
    model: str,
    plan: Any,
    world_size: int | None,
    steps: int,
    device: str | None,
    tolerance: float,
    grad_check: bool,
    timeout: float,
    as_json: bool,
    report_path: Path | None = None,
    plan_path: Path | None = None,
) -> None:
    from memplan import render
    from memplan.distributed import verify_distributed

    with render.progress("verifying on several ranks") as on_progress:
        result = verify_distributed(
            model,
            plan,
            world_size=world_size,
            steps=steps,
            device=device,
            tolerance=tolerance,
            check_gradients=grad_check,
            timeout_s=timeout,
            on_progress=on_progress,
            record_timeline=report_path is not None,
        )
    if as_json:
        data = to_data(result)
        for rank in data["ranks"]:
            rank.pop("timeline", None)  # per-op bytes are for --report, not the JSON
        data.update(
            measured_peak_bytes=result.measured_peak_bytes,
            peak_error=result.peak_error,
            rank_errors=[result.rank_error(r.rank) for r in result.ranks],
            within_budget=result.within_budget,
            passed=result.passed,
            failures=result.failures,
        )
        render.print_json(data)
    else:
        render.show_distributed_verify(result)
    _write_verify_report(result, plan_path, report_path)
    if not result.passed:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------- report
@app.command()
@_run
def report(
    file: Annotated[Path, typer.Argument(metavar="PROFILE|PLAN", help="A plan or profile YAML.")],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="report.html (a page) or report.png.")
    ],
    profile_path: Annotated[
        Path | None,
        typer.Option("--profile", help="The plan's profile, if not where the plan says."),
    ] = None,
    target_batch: Annotated[
        int | None, typer.Option("--target-batch", help="With a profile: solve for this batch.")
    ] = None,
    budget: Annotated[
        str | None, typer.Option(help="With a profile: the budget to solve against.")
    ] = None,
    device_profile: Annotated[
        str | None, typer.Option("--device-profile", help="With a profile: GPU to plan for.")
    ] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing output file.")] = False,
) -> None:
    """Draw where the peak is: predicted memory over one step, candidates, layer choices."""
    from memplan import render
    from memplan.fileio import refuse_existing
    from memplan.report import build_report, check_output, write_report
    from memplan.report.draw import matplotlib_pyplot
    from memplan.units import format_bytes

    check_output(output)
    refuse_existing(output, force=force)
    matplotlib_pyplot()  # a missing extra is an error before any work
    result = build_report(
        file,
        profile_path=profile_path,
        target_batch=target_batch,
        budget=budget,
        device_profile=device_profile,
    )
    size = write_report(result, output, force=force)
    for note in result.notes:
        render.warn(note)
    render.info(
        f"wrote {output} ({format_bytes(size)}): peak {format_bytes(result.timeline.peak_bytes)}"
        f" during {result.timeline.bars[result.timeline.peak_index].where}"
    )


def _check_report_path(path: Path) -> None:
    """Refuse a bad or existing --report path, or a missing matplotlib, before running."""
    from memplan.fileio import refuse_existing
    from memplan.report import check_output
    from memplan.report.draw import matplotlib_pyplot

    check_output(path)
    refuse_existing(path)
    matplotlib_pyplot()


def _write_verify_report(result: Any, plan_path: Path | None, path: Path | None) -> None:
    if path is None or plan_path is None:
        return
    from memplan import render
    from memplan.report import write_verify_report
    from memplan.units import format_bytes

    size = write_verify_report(result, plan_path, path)
    render.info(f"wrote {path} ({format_bytes(size)})")


# ---------------------------------------------------------------------------- devices
@app.command()
@_run
def devices(
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List the GPU specs memplan can plan for (profiles/devices/)."""
    from memplan import render
    from memplan.devices import list_devices, load_device

    specs = [load_device(name) for name in list_devices()]
    if as_json:
        render.print_json([to_data(s) for s in specs])
    else:
        render.show_devices(specs)


# ---------------------------------------------------------------------------- check
cli_check.register(app)


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def main() -> None:
    """Console-script entry point. SIGINT and SIGTERM unwind the command (so temporary files
    and child processes are cleaned up), print one line and exit 128 + the signal number:
    130 for Ctrl-C, 143 for SIGTERM."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        app()
    except (Interrupted, KeyboardInterrupt) as exc:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not print a traceback
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
        raise SystemExit(128 + signum) from None
    finally:
        # The command is over: a Ctrl-C during interpreter shutdown must not turn a finished
        # run into a death by SIGINT (rc -2); SIGTERM keeps its default action.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    main()
