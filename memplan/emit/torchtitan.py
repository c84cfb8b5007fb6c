"""torchtitan's configs (``--format torchtitan`` and ``--format torchtitan-toml``; issues 25, 31).

**torchtitan 0.3.x** (``--format torchtitan``, the release on the package index): it reads no
job TOML (``--job.config_file`` is refused with "--module is required"). ``python -m
torchtitan.train`` takes ``--module`` (a model package, e.g. ``llama3``) and ``--config`` (a
function of that package's ``config_registry`` returning a ``Trainer.Config``), then
overrides parsed by tyro (torchtitan/config/manager.py ``ConfigManager.parse_args``), named
as torchtitan 0.3.0 names them: ``--parallelism.`` ``data_parallel_replicate_degree``,
``data_parallel_shard_degree``, ``tensor_parallel_degree``, ``enable_sequence_parallel``
(``no_enable_sequence_parallel``), ``pipeline_parallel_degree``,
``pipeline_parallel_schedule``, ``pipeline_parallel_microbatch_size``,
``module_fqns_per_model_part`` (the plan's stages, ``stage_fqns``: one comma-separated list
of module names per stage, as 0.3.0's ``ConfigManager`` parses a ``list[str]``, so that
torchtitan runs memplan's blocks on every stage whatever its own default split, 0.3.0's
``_generate_llm_fqn_per_model_part``), ``context_parallel_degree`` (torchtitan/config/
configs.py ``ParallelismConfig``); ``--training.`` ``local_batch_size``,
``global_batch_size``, ``seq_len`` and ``disable_cuda_graphs`` (``TrainingConfig``; a
pipelined ``Trainer.Config`` is refused without the last, and every output sets it:
``CUDA_GRAPHS_NOTE``), and for an fp32 plan ``mixed_precision_param float32``
(``Literal["bfloat16", "float32"]``, default bfloat16: FSDP2's ``param_dtype``, or
autocast's dtype under DDP, so without it an fp32 plan trained in bfloat16; the TOML's
``[training]`` key of 0.1.0 to 0.2.2 too; an fp16 plan, which torchtitan cannot run, trains
in bfloat16, the same bytes, with a comment: ``FP16_NOTE``). Activation checkpointing is a
config class chosen by a tyro subcommand (torchtitan/distributed/activation_checkpoint.py
``ActivationCheckpointingConfig``): ``activation_checkpoint:full`` (``FullAC``: every
block), ``activation_checkpoint:selective`` (``SelectiveAC``: per-op, every block),
``activation_checkpoint:memory-budget`` (``MemoryBudgetAC``: the compiler's partitioner;
memplan never plans it) and ``activation_checkpoint:none``. 0.3 applies one policy to every
block (no every-N-th option), and always shards the head's logits and the loss by
vocabulary under TP (models/common/decoder_sharding.py: the ``lm_head`` output is
``Shard(-1)``; components/loss.py ``_LossParallelCrossEntropy``): there is no
``disable_loss_parallel`` any more. The model's shape is not a command-line field
(``Trainer.Config.model_spec`` is ``tyro.conf.Suppress``): it comes from ``--config`` alone,
so the output names a Llama 3 config only when the plan's model is that config (same block
count and parameter count), and otherwise the closest one with what differs, in a comment.

**torchtitan 0.1.0 to 0.2.2** (``--format torchtitan-toml``): the job TOML those releases read
with ``--job.config_file`` (their ``JobConfig``: torchtitan/config_manager.py in 0.1.0,
torchtitan/config/job_config.py in 0.2.x; every key written here is in all of them but
one): ``[parallelism]`` ``data_parallel_replicate_degree``, ``data_parallel_shard_degree``,
``tensor_parallel_degree``, ``pipeline_parallel_degree``, ``pipeline_parallel_schedule``,
``pipeline_parallel_microbatch_size``, ``context_parallel_degree``,
``disable_loss_parallel``, and with pipeline stages ``module_fqns_per_model_part`` (0.2.0
to 0.2.2, the head named ``output``; 0.1.0 ignores it and 0.2.x refuses 0.1.0's
``pipeline_parallel_split_points``, the first block of each later stage, which a comment
gives instead); ``[training]`` ``local_batch_size`` (per data-parallel rank per
step; with PP split into micro-batches of ``pipeline_parallel_microbatch_size``),
``global_batch_size`` (more than local × dp means gradient accumulation), ``seq_len``;
``[activation_checkpoint]`` ``mode`` (selective, full, none) and ``selective_ac_option``
("op", or "N": every N-th block). torchtitan's Llama TP always shards the norms by sequence
(SequenceParallel), so a plan without SP is written with a comment saying so. A plan whose
blocks differ is written as the nearest every-N-th choice that checkpoints at least as many
blocks (more memory saved, not less), and the comment names the plan's own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from memplan.emit._common import (
    checkpointed_blocks,
    checkpoints_every_block,
    comment_string,
    plan_blocks,
    plan_layout,
)
from memplan.modes import FULL, SELECTIVE
from memplan.parallel import Parallel
from memplan.plan import Plan

TORCHTITAN_STRATEGIES = frozenset({"ddp", "fsdp"})
"""torchtitan replicates (DDP) or shards with FSDP2; it has no optimizer-only sharding."""

TOML_RELEASES = "0.1.0 to 0.2.2"
"""The torchtitan releases that read ``--job.config_file`` with the keys written below."""
RELEASE = "0.3.0"
"""The torchtitan release ``--format torchtitan`` writes for (tests load the output with its
``ConfigManager``)."""

_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
"""memplan's schedule -> torch.distributed.pipelining's class name less ``Schedule``
(what torchtitan's ``pipeline_parallel_schedule`` takes)."""


def stage_fqns(parallel: Parallel, n_blocks: int, head: str = "lm_head") -> list[list[str]]:
    """The plan's pipeline stages as torchtitan's ``module_fqns_per_model_part`` takes them
    (torchtitan 0.2.0 to 0.3.0, ``ParallelismConfig``; one list per stage, stage ``s`` on
    rank ``s % pp`` for the looped schedules): each stage's blocks (``layers.<i>``,
    ``Parallel.stage_ranges``), ``tok_embeddings`` first on the first stage, ``norm`` and
    the head last on the last (``lm_head`` in 0.3.0's Llama 3, ``output`` in 0.2.x's)."""
    stages = [[f"layers.{i}" for i in blocks] for blocks in parallel.stage_ranges(n_blocks)]
    stages[0].insert(0, "tok_embeddings")
    stages[-1] += ["norm", head]
    return stages


def _every(n: int) -> str:
    """1 -> "every block", 2 -> "every 2nd block", 3 -> "every 3rd block", 11 -> "every
    11th block"."""
    if n == 1:
        return "every block"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"every {n}{suffix} block"


def _every_nth(plan: Plan, n_blocks: int) -> int:
    """The largest N such that checkpointing every N-th block covers as many blocks as the
    plan checkpoints; 1 where it checkpoints layers but no block (only torchtitan's blocks
    can be: every block, no more memory than planned)."""
    count = checkpointed_blocks(plan)
    if count == 0:
        return 1
    return max(1, n_blocks // count)


def _toml(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def emit_torchtitan_toml(plan: Plan, *, model_path: str) -> str:
    """torchtitan 0.1.0 to 0.2.2's job config (TOML) for ``plan`` (module docstring)."""
    p = plan_layout(plan)
    modes = set(plan.checkpoint.values())
    n_blocks = plan_blocks(plan)
    notes = [
        f"memplan plan for {comment_string(model_path)}: {p.describe()}, strategy {plan.strategy}"
    ]
    if not plan.checkpoint:
        ac = {"mode": "none"}
    elif modes == {FULL} and checkpoints_every_block(plan):
        ac = {"mode": "full"}
    elif modes == {SELECTIVE} and checkpoints_every_block(plan):
        ac = {"mode": "selective", "selective_ac_option": "op"}
    else:
        nth = _every_nth(plan, n_blocks)
        ac = {"mode": "selective", "selective_ac_option": str(nth)}
        notes.append(
            f"the plan checkpoints {checkpointed_blocks(plan)} of {n_blocks} blocks "
            f"({', '.join(sorted(modes))}); torchtitan checkpoints {_every(nth)} fully"
        )
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's Llama TP always shards the norms by sequence (SP)")
    local = plan.micro_batch_size * (plan.accumulation_steps if p.pp > 1 else 1)
    training = {
        "local_batch_size": local,
        "global_batch_size": plan.target_batch,
    }
    if plan.seq_len is not None:
        training["seq_len"] = plan.seq_len
    if plan.precision == "fp32":  # else bfloat16 (module docstring)
        training["mixed_precision_param"] = "float32"
    if plan.precision == "fp16":
        notes.append(FP16_NOTE)
    parallelism: dict[str, object] = {
        "data_parallel_replicate_degree": p.dp_replicate,
        "data_parallel_shard_degree": p.dp_shard,
        "tensor_parallel_degree": p.tp,
        "pipeline_parallel_degree": p.pp,
        "context_parallel_degree": p.cp,
    }
    if p.tp > 1:  # torchtitan's loss parallel is on unless disabled (JobConfig.Parallelism)
        parallelism["disable_loss_parallel"] = not p.loss_parallel
    if p.pp > 1:
        parallelism["pipeline_parallel_schedule"] = _SCHEDULES[p.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = plan.micro_batch_size
        parallelism["module_fqns_per_model_part"] = stage_fqns(p, n_blocks, head="output")
        starts = [f"layers.{r.start}" for r in p.stage_ranges(n_blocks)[1:]]
        notes.append(
            "pipeline stages as planned (module_fqns_per_model_part, torchtitan 0.2.x; "
            "0.2.x refuses the 0.1.0 key, 0.1.0 ignores this one and splits by its own "
            "rule): for torchtitan 0.1.0 replace it with pipeline_parallel_split_points = "
            + _toml(starts)
        )
    lines = [
        f"# torchtitan {TOML_RELEASES} job config: train with --job.config_file <this file>. "
        "torchtitan 0.3 reads no TOML: use --format torchtitan."
    ]
    lines += [f"# {note}" for note in notes]
    lines.append(
        f"# predicted peak per rank {plan.predicted.peak_bytes} B (worst stage), step "
        f"{plan.predicted.step_seconds:.3f} s"
    )
    sections: list[tuple[str, dict]] = [
        ("training", training),
        ("parallelism", parallelism),
        ("activation_checkpoint", ac),
    ]
    if plan.float8 is not None:
        lines.append(
            '# float8: torchtitan 0.2.x converter "quantize.linear.float8" (0.1.0 names it '
            '"float8": edit [model] converters for it); 0.1.0 reads [float8], 0.2.x '
            "[quantize.linear.float8], each ignores the other's section"
        )
        float8 = {
            "enable_fsdp_float8_all_gather": plan.float8.fsdp_float8_all_gather,
            "precompute_float8_dynamic_scale_for_fsdp": plan.float8.fsdp_float8_all_gather,
            "recipe_name": plan.float8.recipe,
            "filter_fqns": ["output"],
        }
        sections += [
            ("model", {"converters": ["quantize.linear.float8"]}),
            ("float8", float8),
            ("quantize.linear.float8", float8),
        ]
    for section, fields in sections:
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- torchtitan 0.3


@dataclass(frozen=True, slots=True)
class NamedConfig:
    """A Llama 3 config of torchtitan 0.3.0's ``torchtitan.models.llama3.config_registry``."""

    name: str
    blocks: int
    parameters: int
    """Parameters of the model it builds (counted on meta in tests/test_emit_engines.py)."""
    flavor: str
    """Its ``model_registry`` flavor (torchtitan.models.llama3.model_registry)."""
    float8: bool = False
    """Its model_spec converts linears to float8 (``llama3_405b``: ``Float8LinearConverter``
    with ``filter_fqns=["lm_head"]``)."""


LLAMA3_CONFIGS: tuple[NamedConfig, ...] = (
    NamedConfig("llama3_debugmodel", 6, 6_163_712, "debugmodel"),
    NamedConfig("llama3_8b", 32, 8_030_261_248, "8B"),
    NamedConfig("llama3_70b", 80, 70_553_706_496, "70B"),
    NamedConfig("llama3_405b", 126, 405_853_388_800, "405B", float8=True),
)
FLOAT8_MODULE = "memplan_titan_precision"
"""The config_registry module a float8 (or a bf16 405B) snippet writes beside the launch:
torchtitan 0.3 sets float8 in a config function's ``model_registry(converters=...)``, not on
the command line (``Trainer.Config.model_spec`` is ``tyro.conf.Suppress``), and
``--module`` takes a fully-qualified module (torchtitan/config/manager.py)."""
_SAME_PARAMETERS = 0.01
"""How close the plan's parameter count must be to a config's for the config to be the
plan's model (its parameter bytes at 4 or 2 bytes a parameter, fp32 or bf16)."""


def _named_config(plan: Plan, n_blocks: int) -> tuple[NamedConfig, bool]:
    """The Llama 3 config closest to the plan's model (block count first, then parameter
    count), and whether it is the plan's model: the same block count and parameters."""
    fingerprint = plan.model_fingerprint
    param_bytes = fingerprint.parameter_bytes if fingerprint is not None else 0

    def param_gap(config: NamedConfig) -> float:
        if param_bytes <= 0:
            return math.inf
        return min(abs(param_bytes / (e * config.parameters) - 1) for e in (4, 2))

    def distance(config: NamedConfig) -> tuple[float, float]:
        return (abs(math.log(n_blocks / config.blocks)), param_gap(config))

    best = min(LLAMA3_CONFIGS, key=distance)
    same = best.blocks == n_blocks and param_gap(best) <= _SAME_PARAMETERS
    return best, same


def _ac_subcommand(plan: Plan, n_blocks: int) -> tuple[str, list[str]]:
    """torchtitan 0.3's activation-checkpointing subcommand for ``plan``, and notes where it
    is not the plan's own choice."""
    modes = set(plan.checkpoint.values())
    every = checkpoints_every_block(plan)
    if not plan.checkpoint:
        return "none", []
    if modes == {FULL} and every:
        return "full", []
    if modes == {SELECTIVE} and every:  # memplan's selective is SelectiveAC's policy
        return "selective", []
    return "full", [
        f"the plan checkpoints {checkpointed_blocks(plan)} of {n_blocks} blocks "
        f"({', '.join(sorted(modes))}); torchtitan {RELEASE} applies one policy to every "
        "block, so FullAC checkpoints every block: no more memory than planned, more "
        "recompute (memplan.apply on your own model runs the plan's choice)"
    ]


def _precision_module(plan: Plan, config: NamedConfig) -> tuple[str, str] | None:
    """(config function name, module text) where the plan's precision is not the named
    config's: a float8 plan (the converter with the head left in bf16: ``lm_head``, as 0.3's
    own 405B config filters it), or a bf16 plan of a config that converts (405B). None: the
    named config trains as planned."""
    float8 = plan.float8
    if float8 is None and not config.float8:
        return None
    if float8 is None:
        name, converters = f"{config.name}_bf16", "None"
    else:
        name = f"{config.name}_float8"
        converters = (
            '[\n        Float8LinearConverter.Config(\n            recipe_name="rowwise",\n'
            '            filter_fqns=["lm_head"],\n'
            "            model_compile_enabled=config.compile.enable\n"
            '            and "model" in config.compile.components,\n        )\n    ]'
        )
    text = (
        "from torchtitan.components.quantization import Float8LinearConverter\n"
        "from torchtitan.models.llama3 import model_registry\n"
        f"from torchtitan.models.llama3.config_registry import {config.name}\n\n\n"
        f"def {name}():\n"
        f"    config = {config.name}()\n"
        f'    config.model_spec = model_registry("{config.flavor}", converters={converters})\n'
        "    return config\n"
    )
    return name, text


LOSS_NOTE = (
    f"loss: torchtitan {RELEASE}'s llama3 configs run the head and the loss in 8 chunks of "
    "the sequence (ChunkedLossWrapper, --loss.num_chunks), and compile the loss with "
    "--compile.enable; the plan holds the loss your model file computes, so unless it calls "
    "memplan.run.losses.chunked_cross_entropy(hidden, head, targets, chunks=8) (or, compiled, "
    "compiled_cross_entropy) torchtitan holds less at the loss than planned"
)
"""What every ``--format torchtitan`` output says of the loss (torchtitan 0.3.0's
models/llama3/config_registry.py: every Llama config's ``loss`` is ``ChunkedLossWrapper``
with the default ``num_chunks = 8``; config/configs.py ``CompileConfig.components``
defaults to ``["model", "loss"]``). A plan cannot tell which loss its profile measured."""


CUDA_GRAPHS_NOTE = (
    f"--training.disable_cuda_graphs: torchtitan {RELEASE} otherwise captures each step in "
    "CUDA graphs and keeps every rank's gradients allocated between steps "
    "(zero_grad(set_to_none=False)), which the plan frees at zero_grad; without this flag "
    "add one rank's gradients (its shard of them under FSDP, in fp32) to the planned peak"
)
"""Why every ``--format torchtitan`` output passes ``--training.disable_cuda_graphs``
(torchtitan 0.3.0 trainer.py ``Trainer.train_step``: ``self.optimizers.zero_grad(set_to_none=
self.config.training.disable_cuda_graphs)``; config/configs.py: CUDA graphs are on unless
the flag is set, and a pipelined config is refused without it)."""


FP16_NOTE = (
    "precision: torchtitan has no float16 (mixed_precision_param is bfloat16 or float32), "
    "so it trains this fp16 plan in bfloat16: the same bytes an element as planned"
)


def _float8_notes(plan: Plan) -> list[str]:
    float8 = plan.float8
    if float8 is None:
        return []
    notes = [
        f"float8: {float8.converted} linears in float8 (torchao Float8Linear, torchtitan "
        f"{RELEASE}'s Float8LinearConverter), the rest in bf16"
    ]
    if float8.recipe != "rowwise" or float8.fsdp_float8_all_gather:
        notes.append(
            f"torchtitan {RELEASE} has only the rowwise recipe, and gathers weights in bf16 "
            f"(components/quantization/float8.md): memplan planned {float8.recipe} scaling"
            + (" with float8 all-gather" if float8.fsdp_float8_all_gather else "")
            + ", so torchtitan's all-gathers hold twice the converted weights' bytes planned"
        )
    return notes


def torchtitan_args(plan: Plan) -> list[str]:
    """The arguments of ``python -m torchtitan.train`` (torchtitan 0.3.0) for ``plan``, one
    option and its value an item; the last is the activation-checkpointing subcommand."""
    p = plan_layout(plan)
    n_blocks = plan_blocks(plan)
    config, _ = _named_config(plan, n_blocks)
    precision = _precision_module(plan, config)
    module, name = (FLOAT8_MODULE, precision[0]) if precision else ("llama3", config.name)
    args = [
        f"--module {module}",
        f"--config {name}",
        f"--parallelism.data_parallel_replicate_degree {p.dp_replicate}",
        f"--parallelism.data_parallel_shard_degree {p.dp_shard}",
        f"--parallelism.tensor_parallel_degree {p.tp}",
        f"--parallelism.pipeline_parallel_degree {p.pp}",
        f"--parallelism.context_parallel_degree {p.cp}",
    ]
    if p.tp > 1:
        sp = "enable" if p.sequence_parallel else "no_enable"
        args.append(f"--parallelism.{sp}_sequence_parallel")
    if p.pp > 1:
        args += [
            f"--parallelism.pipeline_parallel_schedule {_SCHEDULES[p.schedule]}",
            f"--parallelism.pipeline_parallel_microbatch_size {plan.micro_batch_size}",
        ]
        stages = " ".join(",".join(stage) for stage in stage_fqns(p, n_blocks))
        args.append(f"--parallelism.module_fqns_per_model_part {stages}")
    if plan.compiled:  # the step was timed as compiled: the model and the loss (0.3's default)
        args.append("--compile.enable")
    args.append("--training.disable_cuda_graphs")  # every layout: CUDA_GRAPHS_NOTE says why
    local = plan.micro_batch_size * (plan.accumulation_steps if p.pp > 1 else 1)
    args += [
        f"--training.local_batch_size {local}",
        f"--training.global_batch_size {plan.target_batch}",
    ]
    if plan.seq_len is not None:
        args.append(f"--training.seq_len {plan.seq_len}")
    if plan.precision == "fp32":  # else bfloat16 (module docstring)
        args.append("--training.mixed_precision_param float32")
    args.append(f"activation_checkpoint:{_ac_subcommand(plan, n_blocks)[0]}")
    return args


def emit_torchtitan(plan: Plan, *, model_path: str) -> str:
    """A shell snippet for torchtitan 0.3.0: ``TORCHTITAN_ARGS`` for ``python -m
    torchtitan.train`` (module docstring), with what differs from the plan in comments."""
    p = plan_layout(plan)
    n_blocks = plan_blocks(plan)
    config, same = _named_config(plan, n_blocks)
    notes = [
        f"memplan plan for {comment_string(model_path)}: {p.describe()}, strategy {plan.strategy}",
        f"predicted peak per rank {plan.predicted.peak_bytes} B (worst stage), step "
        f"{plan.predicted.step_seconds:.3f} s",
        f"torchtitan {RELEASE} (--module/--config plus overrides; it reads no job TOML: "
        f"for torchtitan {TOML_RELEASES} use --format torchtitan-toml)",
    ]
    fingerprint = plan.model_fingerprint
    size = (
        f"{fingerprint.parameter_bytes} parameter bytes"
        if fingerprint is not None
        else "parameters unknown"
    )
    if same:
        notes.append(
            f"model: {config.name} ({config.blocks} blocks, {config.parameters} parameters), "
            "as planned"
        )
    else:
        notes.append(
            f"model: no torchtitan config is the planned model ({n_blocks} blocks, {size}); "
            f"the closest is {config.name} ({config.blocks} blocks, {config.parameters} "
            "parameters), which this command trains. torchtitan takes the model's shape from "
            "--config alone: register your model's Trainer.Config in a config_registry module "
            "and pass --module <that module> --config <its function> instead"
        )
    notes += _ac_subcommand(plan, n_blocks)[1]
    if plan.precision == "fp16":
        notes.append(FP16_NOTE)
    notes += _float8_notes(plan)
    notes.append(LOSS_NOTE)
    notes.append(CUDA_GRAPHS_NOTE)
    if not plan.compiled:
        notes.append(
            "the step time is eager's (one kernel an op); with --compile.enable torchtitan "
            "fuses the memory-bound ops and runs faster than planned: probe with --device meta "
            "--compiled to plan the compiled step"
        )
    if p.tp > 1 and not p.loss_parallel:
        notes.append(
            f"torchtitan {RELEASE} always shards the logits and loss by vocabulary under TP "
            "(loss parallel); the plan charged them whole, so torchtitan holds less"
        )
    if p.pp == 1 and p.dp_shard > 1 and p.fsdp_units != "torchtitan-2507":
        notes.append(
            f"FSDP units: torchtitan {RELEASE} shards the embeddings and the norm + head as "
            "units of their own (the embeddings resharded after their forward); the plan keeps "
            "them in one root unit, whole all step, so torchtitan holds less: solve with "
            "--fsdp-units torchtitan-2507 to plan its units"
        )
    if p.pp > 1:
        sizes = [len(r) for r in p.stage_ranges(n_blocks)]
        notes.append(
            f"pipeline stages as planned ({p.stage_split} split, blocks per stage {sizes}): "
            "--parallelism.module_fqns_per_model_part, one comma-separated list per stage"
        )
    notes.append(
        f"launch with {p.world_size} ranks: torchrun --nproc_per_node <gpus per node> "
        "-m torchtitan.train $TORCHTITAN_ARGS"
    )
    body = " \\\n    ".join(torchtitan_args(plan))
    precision = _precision_module(plan, config)
    module = ""
    if precision is not None:
        notes.append(
            f"torchtitan {RELEASE} sets float8 in a config function, not on the command line: "
            f"this snippet writes {FLOAT8_MODULE}.py (launch from this folder, or put it on "
            "PYTHONPATH)"
        )
        module = f"cat > {FLOAT8_MODULE}.py <<'PY'\n{precision[1]}PY\n"
    return "".join(f"# {note}\n" for note in notes) + module + f'TORCHTITAN_ARGS="{body}"\n'
