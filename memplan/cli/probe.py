"""``memplan probe``: measure a model per layer and write its profile."""

from __future__ import annotations

import functools
from typing import Annotated

import typer

from memplan.cli.base import run_command
from memplan.cli.options import (
    DeviceProfileOption,
    ForceOption,
    JsonOption,
    LoraOption,
    ModelArgument,
    OutputOption,
    SeqLenOption,
    TaskOption,
    parse_micro_batches,
    running_user_code,
)
from memplan.errors import BadInputError
from memplan.files.schema import to_data
from memplan.model.reference import model_reference
from memplan.profile.data import TIMING_ROUNDS, timing_rounds_problem
from memplan.profile.seqlen import parse_seq_lens


@run_command
def probe(
    model: ModelArgument,
    task: TaskOption = None,
    seq_len: SeqLenOption = None,
    lora: LoraOption = None,
    seq_lens: Annotated[
        str | None,
        typer.Option(
            "--seq-lens",
            help="Sequence lengths to probe, e.g. 128,256 (make_batch(batch_size, seq_len)): "
            "two or more let `solve --seq-len` plan any length.",
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or meta.")] = "auto",
    micro_batches: Annotated[
        str, typer.Option("--micro-batches", help="Sizes to measure, e.g. 1,2,4.")
    ] = "1,2,4",
    precision: Annotated[
        str,
        typer.Option(
            help="fp32, bf16 or fp16 (autocast), or float8: the linears as torchao's "
            "Float8Linear, the rest in bf16 parameters (FSDP's policy), as torchtitan trains."
        ),
    ] = "fp32",
    float8_recipe: Annotated[
        str,
        typer.Option(
            "--float8-recipe",
            help="With --precision float8: torchao's recipe, tensorwise (float8 all-gather "
            "under FSDP) or rowwise.",
        ),
    ] = "tensorwise",
    float8_all_gather: Annotated[
        bool,
        typer.Option(
            "--float8-all-gather/--no-float8-all-gather",
            help="With --precision float8 (tensorwise): FSDP2 gathers the float8 weights in "
            "float8 (torchao's enable_fsdp_float8_all_gather). Off for plans verified on a "
            "CPU: gloo has no float8 dtype.",
        ),
    ] = True,
    compiled: Annotated[
        bool,
        typer.Option(
            "--compiled",
            help="With --device meta: time the step as torch.compile runs it (the "
            "memory-bound ops between two matmuls fused, each input read once, only what "
            "outlives them written); the memory stays eager's, an upper bound.",
        ),
    ] = False,
    timing_rounds: Annotated[
        int | None,
        typer.Option(
            "--timing-rounds",
            help="cpu and cuda: timing rounds per probed size (1 to 100, default 5); each time is a "
            "median over them. 1 takes about a quarter of the probing time (the bytes are "
            "the same), for a first look or a memory-only gate; its times are one run's. Not with --device "
            "meta.",
        ),
    ] = None,
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
    device_profile: DeviceProfileOption = None,
    output: OutputOption = None,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Measure a model per layer (memory and time) and write a profile."""
    from memplan import render
    from memplan.files.io import check_output, write_text_atomic
    from memplan.probe import probe_model
    from memplan.profile import profile_to_yaml

    if device.lower() not in ("auto", "cpu", "cuda", "meta"):
        raise BadInputError(f"--device {device!r} is not one of auto, cpu, cuda, meta.")
    device = device.lower()  # any case, as --device-profile's names (before: CPU refused)
    if precision not in ("fp32", "bf16", "fp16", "float8"):
        raise BadInputError(f"--precision {precision!r} is not one of fp32, bf16, fp16, float8.")
    sizes = parse_micro_batches(micro_batches)
    if timing_rounds is not None:
        if device == "meta":
            raise BadInputError(
                "--timing-rounds counts the timed runs of a cpu or cuda probe; a meta probe "
                "computes its times on the device spec's clock and runs none.",
                hint="Drop --timing-rounds, or probe with --device cpu or cuda.",
            )
        if problem := timing_rounds_problem(timing_rounds):
            raise BadInputError(
                f"--timing-rounds: {problem}: the timing rounds per probed size.",
                hint=f"Give 1 for a quick probe, or leave it out for {TIMING_ROUNDS}.",
            )
    if output is not None:
        # refuse before minutes of probing, not after; never over the model file itself
        check_output(output, force=force, inputs=_model_files(model))
    lens = parse_seq_lens(seq_lens) if seq_lens is not None else ()
    if seq_lens is not None:
        from memplan.probe.seqgrid import probe_seq_grid

        if seq_len is not None:
            raise BadInputError("--seq-len and --seq-lens: give one (--seq-lens 128,256).")
        probe_model = functools.partial(probe_seq_grid, seq_lens=lens)
    model = model_reference(model, task=task, seq_len=seq_len, lora=lora, seq_lens=lens)
    with (
        running_user_code(model, as_json=as_json),
        render.progress("probing", quiet=as_json) as on_progress,
    ):
        profile = probe_model(
            model,
            device=device,
            micro_batches=sizes,
            precision=precision,
            layers=layers,
            device_profile=device_profile,
            on_progress=on_progress,
            mixed_precision=mixed_precision,
            float8_recipe=float8_recipe,
            float8_all_gather=float8_all_gather,
            compiled=compiled,
            timing_rounds=TIMING_ROUNDS if timing_rounds is None else timing_rounds,
        )
    # The text first: a profile memplan would refuse to read back is exit 3 before anything
    # is shown or written (memplan.profile.profile_to_yaml).
    text = profile_to_yaml(profile)
    if as_json:
        render.print_json(to_data(profile))
    else:
        render.show_profile(profile)
        if profile.extrapolated_layers:
            render.info(
                f"{len(profile.extrapolated_layers)} of {len(profile.layers)} layers "
                f"({profile.extrapolated_layers[0]} … {profile.extrapolated_layers[-1]}) were "
                "derived, not measured: their blocks were shown to be one block repeated, and "
                "the model was probed with the run cut to 4, 5 and 6 blocks"
            )
        elif profile.deduplicated_layers:
            render.info(
                f"{len(profile.deduplicated_layers)} of {len(profile.layers)} layers are "
                "identical to an earlier one and reused its meta measurements"
            )
        if profile.extrapolation_declined:
            render.info(f"every block was measured: {profile.extrapolation_declined}")
    if output is not None:
        write_text_atomic(output, text, force=force)
        render.info(f"wrote {output}")


def _model_files(model: str) -> list[str]:
    """The model file a probe reads (none for an ``hf:`` reference's config folder)."""
    from memplan.model import hf
    from memplan.model.reference import split_model_arg

    if hf.is_hf_reference(model):
        return []
    return [split_model_arg(model)[0]]
