"""Turn a Plan into the configuration files of the training ecosystems: pure text out.

One emitter per format, ``emit_<fmt>(plan, *, model_path) -> str``; ``FORMATS`` maps a format
name to its emitter and suggested file name; ``emit(plan, fmt, model_path)`` returns
``(suggested_filename, text)``. No torch and no rich here (a test checks it): emitting a config
must work on a machine that only plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.emit import (
    accelerate,
    deepspeed,
    hf,
    lightning,
    megatron,
    plan_yaml,
    script,
    torchrun,
    torchtitan,
)
from memplan.emit.accelerate import emit_accelerate
from memplan.emit.deepspeed import emit_deepspeed
from memplan.emit.hf import emit_hf
from memplan.emit.lightning import emit_lightning
from memplan.emit.megatron import emit_megatron
from memplan.emit.plan_yaml import emit_plan
from memplan.emit.script import emit_torch
from memplan.emit.torchrun import emit_torchrun
from memplan.emit.torchtitan import emit_torchtitan, emit_torchtitan_toml
from memplan.errors import BadInputError, MemplanError, UnreadableOutputError
from memplan.plan import Plan
from memplan.suggest import did_you_mean

__all__ = [
    "FORMATS",
    "Emitted",
    "Format",
    "emit",
    "emit_accelerate",
    "emit_all",
    "emit_deepspeed",
    "emit_hf",
    "emit_lightning",
    "emit_megatron",
    "emit_plan",
    "emit_torch",
    "emit_torchrun",
    "emit_torchtitan",
    "emit_torchtitan_toml",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Format:
    name: str
    filename: str
    """Suggested output file name."""
    description: str
    emitter: Callable[..., str]
    strategies: frozenset[str]
    """Plan strategies the format writes faithfully (its emitter module's ``STRATEGIES``);
    for any other, ``emit`` refuses rather than write a config that runs another one."""
    layouts: bool = False
    """Whether it writes tensor, pipeline and context parallel degrees; a plan with any of
    them above 1 is refused by the formats that do not."""
    float8: bool = False
    """Whether it writes a float8 plan's linears as float8 (the plan itself, the scripts'
    ``convert_for_plan``, torchtitan's converter, Megatron's ``--fp8-*``); a float8 plan is
    refused by the formats that do not, whose config would train every linear in bf16."""
    notes: Callable[[Plan], list[str]] | None = None
    """For a format whose file takes no comments (JSON): what its user must still do, which
    ``memplan solve`` prints beside the file it wrote."""
    folder_options: Callable[[Path], dict[str, Any]] | None = None
    """The emitter's options for a file written into a folder (as ``memplan solve`` names it,
    from the folder it runs in): the hf format's path of the DeepSpeed file it names."""


FORMATS: dict[str, Format] = {
    fmt.name: fmt
    for fmt in (
        Format(
            name="plan",
            filename="plan.yaml",
            description="memplan plan (YAML)",
            emitter=emit_plan,
            strategies=plan_yaml.STRATEGIES,
            float8=True,
        ),
        Format(
            name="hf",
            filename="hf_training_args.yaml",
            description="Hugging Face TrainingArguments (YAML)",
            emitter=emit_hf,
            strategies=hf.STRATEGIES,
            folder_options=hf.folder_options,
        ),
        Format(
            name="deepspeed",
            filename="ds_config.json",
            description="DeepSpeed config (JSON)",
            emitter=emit_deepspeed,
            strategies=deepspeed.STRATEGIES,
            notes=deepspeed.deepspeed_notes,
        ),
        Format(
            name="accelerate",
            filename="accelerate_config.yaml",
            description="Accelerate config (YAML)",
            emitter=emit_accelerate,
            strategies=accelerate.STRATEGIES,
        ),
        Format(
            name="lightning",
            filename="lightning_config.yaml",
            description="LightningCLI trainer config (YAML)",
            emitter=emit_lightning,
            strategies=lightning.STRATEGIES,
        ),
        Format(
            name="torch",
            filename="train_memplan.py",
            description="runnable PyTorch training script",
            emitter=emit_torch,
            strategies=script.STRATEGIES,
            float8=True,
        ),
        Format(
            name="torchrun",
            filename="train_torchrun.py",
            description="torchrun training script (DDP / ZeRO-1 / FSDP2) with launch commands",
            emitter=emit_torchrun,
            strategies=torchrun.STRATEGIES,
            float8=True,
        ),
        Format(
            name="torchtitan",
            filename="torchtitan_args.sh",
            description=f"torchtitan {torchtitan.RELEASE} train arguments (--module, --config, "
            "parallelism, batch sizes, seq_len, AC class)",
            emitter=emit_torchtitan,
            strategies=torchtitan.TORCHTITAN_STRATEGIES,
            layouts=True,
            float8=True,
        ),
        Format(
            name="torchtitan-toml",
            filename="torchtitan.toml",
            description=f"torchtitan {torchtitan.TOML_RELEASES} job config (TOML, "
            "--job.config_file)",
            emitter=emit_torchtitan_toml,
            strategies=torchtitan.TORCHTITAN_STRATEGIES,
            layouts=True,
            float8=True,
        ),
        Format(
            name="megatron",
            filename="megatron_args.sh",
            description="Megatron-LM pretrain_gpt.py arguments (TP, PP, CP, SP, recompute)",
            emitter=emit_megatron,
            strategies=megatron.MEGATRON_STRATEGIES,
            layouts=True,
            float8=True,
        ),
    )
}
LAYOUT_FORMATS = frozenset({"plan", "torch", "torchrun"})
"""Formats besides the layout engines' that write a layout plan (the plan itself; the torch
scripts apply TP and PP with torch's own APIs)."""
SCRIPT_FORMATS = frozenset({"torch", "torchrun"})
"""The scripts on memplan's runtime (``run/parallel.build_layout``), which runs TP and PP
but not context parallelism: a plan with ``cp`` above 1 is refused by them."""


def layout_formats(plan: Plan) -> list[str]:
    """The formats that write ``plan``'s layout: the layout engines' and those of
    ``LAYOUT_FORMATS`` that run it (not the scripts for context parallelism)."""
    cp = plan.parallel is not None and plan.parallel.cp > 1
    return [
        f.name
        for f in FORMATS.values()
        if (f.layouts or f.name in LAYOUT_FORMATS)
        and not (cp and f.name in SCRIPT_FORMATS)
        and plan.strategy in f.strategies
    ]


def emit(plan: Plan, fmt: str, model_path: str | None = None, **options: Any) -> tuple[str, str]:
    """``(suggested_filename, text)`` of ``plan`` in format ``fmt``. ``model_path`` defaults to
    ``plan.model``; ``options`` go to the emitter (e.g. ``candidate_layers`` for ``hf``)."""
    if fmt not in FORMATS:
        maybe = did_you_mean(fmt, list(FORMATS), n=1)
        raise BadInputError(
            f"Unknown output format {fmt!r}.",
            hint=f"{maybe + ' ' if maybe else ''}Formats: {', '.join(FORMATS)}.",
        )
    spec = FORMATS[fmt]
    if plan.strategy not in spec.strategies:
        able = [f.name for f in FORMATS.values() if plan.strategy in f.strategies]
        raise BadInputError(
            f"--format {fmt} cannot write a {plan.strategy} plan: its config would run "
            f"{'/'.join(sorted(spec.strategies))} instead, which memplan did not plan for.",
            hint=f"Formats that write {plan.strategy}: {', '.join(able)}.",
        )
    layout = plan.parallel
    if (
        layout is not None
        and max(layout.tp, layout.pp, layout.cp) > 1
        and not (spec.layouts or fmt in LAYOUT_FORMATS)
    ):
        raise BadInputError(
            f"--format {fmt} cannot write a plan with tensor, pipeline or context parallelism "
            f"({layout.describe()}): its config would run data parallelism only.",
            hint=f"Formats that write this layout: {', '.join(layout_formats(plan))}.",
        )
    if layout is not None and layout.cp > 1 and fmt in SCRIPT_FORMATS:
        raise BadInputError(
            f"--format {fmt} cannot write a plan with context parallelism "
            f"({layout.describe()}): its script runs on memplan's runtime, which runs tensor "
            "and pipeline parallelism but not context parallelism (no ring attention), so "
            "the script could only refuse to start.",
            hint=f"Formats that write this layout: {', '.join(layout_formats(plan))}; or "
            "solve with --cp 1 for the scripts.",
        )
    if plan.float8 is not None and not spec.float8:
        raise float8_refusal(plan, spec)
    return spec.filename, spec.emitter(plan, model_path=model_path or plan.model, **options)


def float8_refusal(plan: Plan, spec: Format) -> BadInputError:
    """Why ``spec`` cannot write a float8 plan, and what can: its file has no setting memplan
    writes for torchao's float8 linears, so it would train them in the compute dtype."""
    float8 = plan.float8
    assert float8 is not None
    able = [
        f.name
        for f in FORMATS.values()
        if f.float8 and f.name != "plan" and plan.strategy in f.strategies
    ]
    where = (
        f"--format {', '.join(able)} (they convert the linears)"
        if able
        else f"no --format of a {plan.strategy} plan (solve with --strategy fsdp or ddp for "
        "--format torch, torchrun, torchtitan or megatron)"
    )
    accelerate = (
        " (not Accelerate's mixed_precision='fp8': its filter converts other linears than "
        "memplan measured)"
        if spec.name == "accelerate"
        else ""
    )
    return BadInputError(
        f"--format {spec.name} cannot write a float8 plan: memplan writes no float8 setting in "
        f"its {spec.description}, so it would train the {float8.converted} linears the probe "
        f"converted to torchao's Float8Linear ({float8.recipe} scaling) in {plan.precision}, "
        "with memory and step time memplan did not plan for.",
        hint=f"Emit {where}; or, in your own script, call "
        "memplan.integrations.accelerate.prepare_model(model, plan) before handing the model "
        f"to the trainer{accelerate}: it converts the plan's linears as the probe did.",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Emitted:
    """What ``emit_all`` made: files to write, and the formats it refused, with why."""

    files: list[tuple[str, str, str]]
    """(format, suggested file name, text)."""
    refused: list[tuple[str, MemplanError]]
    notes: list[tuple[str, str]]
    """(format, note) for the formats whose files take no comments (``Format.notes``)."""


def emit_all(
    plan: Plan, formats: list[str], model_path: str | None = None, folder: Path | None = None
) -> Emitted:
    """Every format of ``formats`` that can write ``plan``; a refusal of one does not stop
    the others (the caller writes them, then reports the refusals). ``folder``: where the
    files go, as named from the working folder (``Format.folder_options``)."""
    files, refused, notes = [], [], []
    for fmt in formats:
        spec = FORMATS.get(fmt)
        options = (
            spec.folder_options(folder)
            if spec is not None and spec.folder_options is not None and folder is not None
            else {}
        )
        try:
            filename, text = emit(plan, fmt, model_path, **options)
        except UnreadableOutputError:
            raise  # memplan's own failure (exit 3), not a format that cannot write the plan
        except MemplanError as exc:
            refused.append((fmt, exc))
            continue
        files.append((fmt, filename, text))
        if FORMATS[fmt].notes is not None:
            notes += [(fmt, note) for note in FORMATS[fmt].notes(plan)]
    return Emitted(files=files, refused=refused, notes=notes)
