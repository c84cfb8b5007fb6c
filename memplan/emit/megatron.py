"""Megatron-LM's arguments (``--format megatron``, issue 25).

**Megatron-LM** (``--format megatron``): ``pretrain_gpt.py`` arguments from
``megatron/training/arguments.py``: ``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size``, ``--context-parallel-size``, ``--sequence-parallel``,
``--pipeline-model-parallel-layout`` (with pipeline stages: the plan's own stages, see
``pipeline_layout``), ``--micro-batch-size``,
``--global-batch-size``, ``--bf16`` or ``--fp16`` (the plan's precision: without either
Megatron-LM trains fp32 parameters), ``--seq-length`` (a plan made at a sequence length; Megatron's
``validate_args`` then asserts ``--max-position-embeddings`` ≥ it, a model argument the
snippet leaves to the user and names in a comment), ``--recompute-granularity full|selective``,
``--recompute-method block`` with ``--recompute-num-layers`` (the first N blocks of each
stage: memplan's choice also favours the earliest blocks), ``--use-distributed-optimizer``
for sharded optimizer state, ``--use-torch-fsdp2`` for FSDP.

A float8 plan (issue 34) adds Transformer Engine's float8 (Megatron-LM d98e8a6
megatron/core/transformer/transformer_config.py ``fp8``, ``fp8_recipe``):
``--fp8-format hybrid`` (E4M3 for activations and weights, E5M2 for output gradients: the
dtypes torchao's default ``Float8LinearConfig`` casts to), ``--fp8-recipe tensorwise``
(per-tensor current scaling, torchao's dynamic tensorwise; torchao's rowwise has no
Megatron recipe, and ``blockwise``, the nearest finer one, is written with a comment), and
``--fp8-param-gather`` (weights all-gathered in float8, megatron/training/arguments.py:
with the distributed optimizer or FSDP2 only) when the plan gathers them so. The
delayed-scaling recipe's ``--fp8-amax-history-len`` and ``--fp8-amax-compute-algo`` are not
written: memplan plans current (dynamic) scaling, which uses no amax history.
"""

from __future__ import annotations

from memplan.emit._common import comment_string, plan_block_names, plan_blocks, plan_layout
from memplan.modes import SELECTIVE
from memplan.plan import Plan

MEGATRON_STRATEGIES = frozenset({"ddp", "zero1", "fsdp"})
"""Megatron-LM: DDP, its distributed optimizer (ZeRO-1), FSDP2."""

PRECISION_FLAGS = {"bf16": "--bf16", "fp16": "--fp16"}
"""The plan's precision as Megatron-LM's flag (megatron/training/arguments.py: without
either, ``params_dtype`` is float32); an fp32 plan writes none."""


def pipeline_layout(stages: list[range]) -> str:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` for memplan's stages (``stages[s]``:
    the blocks of stage ``s`` of ``pp × virtual_stages``, on pipeline rank ``s mod pp``, as
    Megatron numbers them too): one character a layer, ``E`` the embedding on the first
    stage, ``t`` a decoder block, ``L`` the output layer and loss on the last, stages split by
    ``|`` (megatron/core/transformer/pipeline_parallel_layer_layout.py ``parse_str_to_list``,
    Megatron-LM d98e8a6; megatron-core 0.16.1). Megatron then runs the plan's blocks on every
    stage whatever the split rule, where its default splits the blocks evenly and refuses
    a count the stages do not divide (126 blocks over 8). The ``x*n`` shorthand is not
    written: the snippet's words are expanded unquoted, and ``*`` could glob."""
    last = len(stages) - 1
    return "|".join(
        ("E" if s == 0 else "") + "t" * len(blocks) + ("L" if s == last else "")
        for s, blocks in enumerate(stages)
    )


def megatron_args(plan: Plan) -> list[str]:
    """Megatron-LM's arguments for ``plan`` (module docstring)."""
    p = plan_layout(plan)
    args = [
        f"--tensor-model-parallel-size {p.tp}",
        f"--pipeline-model-parallel-size {p.pp}",
        f"--context-parallel-size {p.cp}",
        f"--micro-batch-size {plan.micro_batch_size}",
        f"--global-batch-size {plan.target_batch}",
    ]
    if plan.seq_len is not None:
        args.append(f"--seq-length {plan.seq_len}")
    if plan.precision in PRECISION_FLAGS:  # Megatron-LM's default is fp32 parameters
        args.append(PRECISION_FLAGS[plan.precision])
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    if p.pp > 1:
        args.append(
            f"--pipeline-model-parallel-layout {pipeline_layout(p.stage_ranges(plan_blocks(plan)))}"
        )
    if plan.strategy == "zero1":
        args.append("--use-distributed-optimizer")
    if plan.strategy == "fsdp":
        args.append("--use-torch-fsdp2")
    if plan.float8 is not None:
        recipe = "tensorwise" if plan.float8.recipe == "tensorwise" else "blockwise"
        args += ["--fp8-format hybrid", f"--fp8-recipe {recipe}"]
        if plan.float8.fsdp_float8_all_gather and plan.strategy in ("zero1", "fsdp"):
            args.append("--fp8-param-gather")
    modes = set(plan.checkpoint.values())
    if modes == {SELECTIVE}:
        args.append("--recompute-granularity selective")
    elif plan.checkpoint:
        per_stage = p.stage_ranges(plan_blocks(plan))
        names = plan_block_names(plan)
        most = max(
            sum(1 for j in stage if j < len(names) and names[j] in plan.checkpoint)
            for stage in per_stage
        )
        args += [
            "--recompute-granularity full",
            "--recompute-method block",
            f"--recompute-num-layers {max(most, 1)}",
        ]
    return args


def emit_megatron(plan: Plan, *, model_path: str) -> str:
    """A shell snippet: ``MEMPLAN_ARGS`` for ``pretrain_gpt.py``."""
    p = plan_layout(plan)
    body = " \\\n    ".join(megatron_args(plan))
    seq = (
        f"# Sequence length {plan.seq_len}: give --max-position-embeddings >= {plan.seq_len} "
        "with the model args (Megatron's validate_args asserts it)\n"
        if plan.seq_len is not None
        else ""
    )
    float8 = ""
    if plan.float8 is not None and plan.float8.recipe != "tensorwise":
        float8 = (
            f"# float8: memplan planned torchao's {plan.float8.recipe} scaling; Transformer "
            "Engine has no rowwise recipe: blockwise (1x128 / 128x128 scales) is the nearest\n"
        )
    return (
        f"# memplan plan for {comment_string(model_path)}: {p.describe()}, strategy {plan.strategy}\n"
        f"# predicted peak per rank {plan.predicted.peak_bytes} B (worst stage)\n"
        f"{seq}{float8}"
        f"# Launch with {p.world_size} ranks: torchrun ... pretrain_gpt.py $MEMPLAN_ARGS <model args>\n"
        f'MEMPLAN_ARGS="{body}"\n'
    )
