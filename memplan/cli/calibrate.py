"""``memplan calibrate``: measure what this machine's device reaches (memplan.probe.calibrate)
and write a device spec of one's own: the base spec's capacity, peaks and links, with the
efficiencies measured here, for ``--device-profile PATH``."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from memplan.cli.base import run_command
from memplan.cli.options import ForceOption, JsonOption

if TYPE_CHECKING:
    from memplan.devices import Measurement


@run_command
def calibrate(
    base: Annotated[
        str,
        typer.Argument(
            help="The device spec to start from (a name from `memplan devices`, or a spec "
            "file): its capacity, peaks and links are kept; the efficiencies are measured."
        ),
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="The spec file to write (YAML).")],
    device: Annotated[
        str, typer.Option(help="Where to measure: cuda (the default where a GPU is), or cpu.")
    ] = "auto",
    precision: Annotated[
        str, typer.Option(help="The matmul and attention dtype: bf16, fp16 or fp32.")
    ] = "bf16",
    name: Annotated[
        str | None, typer.Option(help="The new spec's name (default: the file's stem).")
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Fewer and smaller sizes (two GEMMs, one attention shape, a smaller copy).",
        ),
    ] = False,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Measure this device's matmul, attention and memory rates and write a device spec
    with them as its efficiencies (for a GPU that differs from the shipped spec's)."""
    from memplan import render
    from memplan.devices import (
        calibrated_spec,
        calibrated_yaml,
        load_device,
        names_spec_file,
        spec_file_label,
    )
    from memplan.errors import BadInputError
    from memplan.files.io import check_output, write_text_atomic
    from memplan.files.schema import to_data

    if precision not in ("bf16", "fp16", "fp32"):
        raise BadInputError(
            f"--precision {precision!r} is not one calibrate measures.",
            hint="Use bf16, fp16 or fp32.",
        )
    if device not in ("auto", "cuda", "cpu"):
        raise BadInputError(
            f"--device {device!r} is not one calibrate runs on.", hint="Use cuda or cpu."
        )
    # before a minute of measuring, and before the name is read: a folder ('.', '/', '')
    # has no name to add .yaml to (it raised ValueError, exit 1)
    check_output(output, force=force)
    if not names_spec_file(output):
        raise BadInputError(
            f"-o {output}: a device spec file's name ends in .yaml or .yml, which is how "
            "--device-profile tells a spec file from a shipped spec's name.",
            hint=f"Write it as -o {output.with_name(output.name + '.yaml')}.",
        )
    base_spec = load_device(base)
    base_spec.peak_flops(precision)  # refuses a precision the base does not have, before measuring

    from memplan.probe.calibrate import machine, measure, sizes_for

    here = machine(device)  # exit 3 for --device cuda where torch sees no GPU
    if here.device.type == "cpu" and base_spec.memory_bytes is not None:  # a GPU's spec
        if device == "auto":  # before: the CPU measured, silently, as the GPU's efficiencies
            raise BadInputError(
                f"calibrate {base}: no GPU was found (torch sees no CUDA device), and "
                f"{base_spec.display_name} is a GPU's spec: its efficiencies measured on "
                "this machine's CPU would be the CPU's, thousands of times below the GPU's.",
                hint="Run calibrate on the machine with the GPU; or, to calibrate the CPU "
                f"against {base} as the base after all, pass --device cpu.",
            )
        render.warn(
            f"--device cpu: the rates measured are this machine's CPU's, written as the "
            f"efficiencies of {base_spec.display_name}, a GPU's spec: plans with this spec "
            "will be timed at CPU speed."
        )
    label = spec_file_label(base) or base_spec.name
    float8 = base_spec.fp8_flops is not None  # float8 GEMMs too, where the base has a peak
    with render.progress("calibrate", quiet=as_json) as update:
        total = 5 if float8 else 4
        done: list[str] = []

        def heard(m: Measurement) -> None:
            done.append(m.kind)
            update(len(done), total, f"{m.kind} {m.rate:.4g} at {m.shape}")

        measurements = measure(
            here.device, precision, sizes_for(here.device, quick), on_done=heard, float8=float8
        )
    stem = name or output.stem
    spec = calibrated_spec(
        base_spec,
        measurements,
        precision=precision,
        name=stem,
        display_name=f"{base_spec.display_name}, calibrated on {here.name}",
        base_label=label,
    )
    header = [
        f"{spec.display_name}: written by `memplan calibrate {base}` on "
        f"{datetime.date.today().isoformat()} (torch {here.torch_version}).",
        f"Capacity, peaks and links: the base spec {label}; interconnect efficiency: the "
        "base's (calibrate runs on one device).",
        *([here.power_note] if here.power_note else []),
        "Efficiency = the rate measured here / the base's peak (FLOPs as memplan's roofline counts them):",
        *(f"  {m.kind}: {m.rate:.4g} {m.unit} at {m.shape}" for m in measurements),
    ]
    if float8 and not any(m.kind == "float8_matmul" for m in measurements):
        header.append(
            "float8_matmul: not measured (this device's torch runs no float8 GEMM): the base's."
        )
    written = write_text_atomic(output, calibrated_yaml(spec, header), force=force)
    if as_json:
        render.print_json(
            {
                "spec": to_data(spec),
                "file": str(written),
                "measured": [to_data(m) for m in measurements],
            }
        )
        return
    for m in measurements:
        render.info(
            f"{m.kind}: {m.rate:.4g} {m.unit} at {m.shape}: efficiency "
            f"{getattr(spec.efficiency, m.kind):.4g}"
        )
    render.info(f"wrote {written}: plan with --device-profile {written}")
