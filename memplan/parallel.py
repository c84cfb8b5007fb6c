"""The parallel layout of a plan (issue 25): how the world's ranks divide into data-parallel
replicas and shards, and tensor-, pipeline- and context-parallel groups, as torchtitan's
``ParallelDims`` composes them (world = dp_replicate × dp_shard × cp × tp × pp). No torch.

A plan without a layout (``Plan.parallel is None``) is today's data parallelism: its
``world_size`` ranks all hold the model under its ``strategy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from memplan.errors import BadInputError

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
"""Pipeline schedules: GPipe (all forwards, then all backwards), 1F1B (the first stage holds
up to pp micro-batches in flight), interleaved 1F1B (``virtual_stages`` stages per rank)."""

KeptOutputs = Literal["none", "last", "all"]
KEPT_OUTPUTS: tuple[KeptOutputs, ...] = ("none", "last", "all")
"""Which pipeline stages keep every micro-batch's forward output to the end of the step, an
engine-version rule (``Parallel.kept_outputs``)."""

FsdpUnits = Literal["memplan", "torchtitan-2507"]
FSDP_UNITS: tuple[FsdpUnits, ...] = ("memplan", "torchtitan-2507")
"""How FSDP2 groups the parameters outside the blocks into units (``Parallel.fsdp_units``),
an engine-version rule."""

StageSplit = Literal["memplan", "torchtitan-2412", "torchtitan-2504"]
STAGE_SPLITS: tuple[StageSplit, ...] = ("memplan", "torchtitan-2412", "torchtitan-2504")
"""How the blocks are divided into pipeline stages (``Parallel.stage_split``,
``split_stages``): memplan's own rule, or an engine version's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Dimension:
    """One parallel dimension: a degree of ``Parallel`` and what it divides."""

    field: str
    """The ``Parallel`` field holding its degree."""
    label: str
    """How a summary names it (``Parallel.describe``)."""
    splits: str
    """What its ranks divide among them."""


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(field="dp_replicate", label="replicas", splits="samples (whole replicas)"),
    Dimension(
        field="dp_shard",
        label="shards",
        splits="samples, and parameters, gradients and optimizer state",
    ),
    Dimension(field="tp", label="tp", splits="the projections' weights and activations"),
    Dimension(field="pp", label="pp", splits="the blocks, as pipeline stages"),
    Dimension(field="cp", label="cp", splits="the sequence"),
)
"""The dimensions in torchtitan's ``ParallelDims`` order; their degrees multiply to the
world size. Adding one: its field on ``Parallel`` and an entry here, then the files
docs/design.md lists under "What a new piece touches"."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel:
    """Degrees of each parallel dimension; their product is the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or HSDP's replicate dimension)."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP2 ``fully_shard`` over this many ranks)."""
    tp: int = 1
    """Tensor-parallel degree: the attention and MLP projections split colwise/rowwise."""
    pp: int = 1
    """Pipeline stages (ranks in a pipeline)."""
    cp: int = 1
    """Context-parallel degree: the sequence split across ranks, K/V exchanged."""
    sequence_parallel: bool = False
    """With ``tp``: the norm/dropout regions sharded by sequence too (Megatron's SP)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule (only meaningful with ``pp`` > 1)."""
    virtual_stages: int = 1
    """Stages per pipeline rank; more than 1 only with ``interleaved_1f1b``."""
    loss_parallel: bool = False
    """With ``tp``: the head's logits and the cross-entropy stay sharded by vocabulary over
    the TP ranks (torchtitan's ``loss_parallel``, on unless
    ``parallelism.disable_loss_parallel``; Megatron's vocab-parallel cross-entropy, always)
    instead of gathered whole on every rank. Off in plans written before it."""
    kept_outputs: KeptOutputs = "none"
    """With ``pp`` > 1: which stages keep every micro-batch's forward output until the step
    ends (``PipelineStage.output_chunks``, cleared at the next step's start), beside the one
    each micro-batch in flight holds. ``none``: torch 2.13's ``schedule.step(...,
    return_outputs=False)``, what memplan's runtime and torchtitan since e5ef99a (October
    2025) run. ``last``: the last stage's, ``return_outputs=True`` (torch's default; from
    pytorch/pytorch#153383, May 2025, on), which ``step`` also concatenates into one tensor
    at its end (``_merge_outputs``). ``all``: every stage's, torch before #153383 (torch
    2.6.0's stage.py ``forward_one_chunk`` appends every stage's output, which
    ``get_fwd_send_ops`` sends from), the torch of torchtitan's December 2024 runs."""
    stage_split: StageSplit = "memplan"
    """With ``pp`` > 1: which rule divides the blocks into the ``stages`` contiguous stages
    (``stage_ranges``, ``split_stages``), an engine-version rule like ``kept_outputs``.
    ``memplan``: memplan's own (``stage_layers``: the later stages take the extra blocks),
    what memplan's runtime runs. ``torchtitan-2412``: torchtitan 9dec370 (December 2024, the
    published Llama 3.1 runs), torchtitan/parallelisms/pipelining_utils.py
    ``generate_split_points``. ``torchtitan-2504``: torchtitan f64cf3c (April 2025,
    pytorch/torchtitan#1103) to 0.3.0, torchtitan/distributed/pipeline_parallel.py
    ``_generate_llm_fqn_per_model_part`` in 0.3.0, with its default first/last-stage
    weights of one block each. Engines without a default of their own take the plan's stages
    as ``--format torchtitan`` writes them (``module_fqns_per_model_part``)."""

    fsdp_units: FsdpUnits = "memplan"
    """With ``dp_shard`` > 1 and no pipeline stages: how FSDP2 groups the parameters outside
    the blocks, an engine-version rule like ``stage_split``. ``memplan``: one root unit
    (embeddings, final norm, head), gathered from its first forward to the backward's end
    (FSDP2 keeps the root unit whole after forward), what memplan's runtime ran before and
    torchtitan 9dec370 (December 2024, the published runs: ``fully_shard(model)`` over them).
    ``torchtitan-2507``: torchtitan 83e6941 (July 2025, pytorch/torchtitan#1094) to 0.3.0
    (torchtitan/distributed/fsdp.py ``apply_fsdp_to_decoder``): the embeddings a unit of
    their own, resharded after their forward; the final norm and the head one unit, not
    resharded after forward, so whole from their forward to their backward, where they
    reduce-scatter their gradients; no parameters left to the root (memplan.memory.
    edge_units). Under pipeline stages every unit stays whole all step either way."""

    def __post_init__(self) -> None:
        for name in (*(d.field for d in DIMENSIONS), "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs tp > 1")
        if self.loss_parallel and self.tp == 1:
            raise ValueError("parallel.loss_parallel needs tp > 1")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError("parallel.virtual_stages > 1 needs schedule interleaved_1f1b")
        if self.kept_outputs not in KEPT_OUTPUTS:
            raise ValueError(
                f"parallel.kept_outputs must be one of {', '.join(KEPT_OUTPUTS)}, "
                f"got {self.kept_outputs!r}"
            )
        if self.stage_split not in STAGE_SPLITS:
            raise ValueError(
                f"parallel.stage_split must be one of {', '.join(STAGE_SPLITS)}, "
                f"got {self.stage_split!r}"
            )
        if self.fsdp_units not in FSDP_UNITS:
            raise ValueError(
                f"parallel.fsdp_units must be one of {', '.join(FSDP_UNITS)}, "
                f"got {self.fsdp_units!r}"
            )

    @property
    def dp(self) -> int:
        """Data-parallel ranks: samples of the effective batch are split over these."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d.field) for d in DIMENSIONS)

    @property
    def edge_units(self) -> bool:
        """Whether the parts outside the blocks are torchtitan's two FSDP units: its rule
        (``fsdp_units`` torchtitan-2507) and no pipeline stages, under which every unit
        stays whole all step whatever the grouping."""
        return self.fsdp_units == "torchtitan-2507" and self.pp == 1

    @property
    def stages(self) -> int:
        """Pipeline stages in all: ``pp × virtual_stages``."""
        return self.pp * self.virtual_stages

    def stage_ranges(self, n_blocks: int) -> tuple[range, ...]:
        """Each pipeline stage's blocks (``stages`` of them, stage ``s`` on rank ``s % pp``)
        under ``stage_split``: ``split_stages``."""
        return split_stages(n_blocks, self.stages, self.stage_split)

    def describe(self) -> str:
        """``dp 2 (shard 2) × tp 2 × pp 1 × cp 1``-style summary for reasons and tables."""
        dp = f"dp {self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp += f" ({self.dp_replicate} replicas × {self.dp_shard} shards)"
        tp = f"tp {self.tp}" + (" + SP" if self.sequence_parallel else "")
        parts = [dp, tp + (" + loss parallel" if self.loss_parallel else "")]
        split = f", {self.stage_split} stages" if self.stage_split != "memplan" else ""
        parts.append(f"pp {self.pp}" + (f" ({self.schedule}{split})" if self.pp > 1 else ""))
        parts.append(f"cp {self.cp}")
        if self.fsdp_units != "memplan" and self.dp_shard > 1 and self.pp == 1:
            parts[0] += f" ({self.fsdp_units} units)"
        return " × ".join(parts)


def stage_layers(n_layers: int, stages: int) -> tuple[range, ...]:
    """The repeated blocks of each pipeline stage, contiguous, in order: ``n_layers`` split
    into ``stages`` runs whose lengths differ by at most one, the *later* stages taking the
    extra layers (the first stage holds the most micro-batches in flight under 1F1B and the
    embeddings; the last holds the head, which for a language model is smaller than the
    first stage's in-flight activations). Stages may be empty only when there are fewer
    layers than stages (refused by the solver)."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s >= stages - extra else 0)
        out.append(range(start, start + size))
        start += size
    return tuple(out)


def _torchtitan_2412(n: int, stages: int) -> list[int]:
    """Blocks per stage by torchtitan 9dec370's ``generate_split_points``
    (torchtitan/parallelisms/pipelining_utils.py, December 2024): ``n // stages`` on the
    first stage, one more on each middle stage while the remainder lasts, the rest on the
    last (so with a remainder of ``stages − 1`` the last also takes one more)."""
    base, extra = divmod(n, stages)
    sizes = [base] + [base + (1 if s <= extra else 0) for s in range(1, stages - 1)]
    return [*sizes, n - sum(sizes)] if stages > 1 else [n]


def _torchtitan_2504(n: int, stages: int) -> list[int]:
    """Blocks per stage by torchtitan 0.3.0's ``_generate_llm_fqn_per_model_part``
    (torchtitan/distributed/pipeline_parallel.py; the rule of f64cf3c, April 2025): the
    embeddings and the norm + head each weigh one block
    (``pipeline_parallel_first_stage_less_layers`` and ``_last_``, default 1), the ``n + 2``
    weighted blocks are divided evenly with the remainder on the first stages, and the
    first and last stages hold one block fewer."""
    if stages == 1:
        return [n]
    base, extra = divmod(n + 2, stages)
    sizes = [base + (1 if s < extra else 0) for s in range(stages)]
    sizes[0] -= 1
    sizes[-1] -= 1
    return sizes


def split_stages(n_blocks: int, stages: int, rule: StageSplit = "memplan") -> tuple[range, ...]:
    """The blocks of each of ``stages`` pipeline stages, contiguous and in order, under
    ``rule`` (``Parallel.stage_split``). Every stage holds at least one block: a split that
    leaves one empty (more stages than blocks; torchtitan-2504 with a stage of embeddings or
    head alone) is refused (BadInputError)."""
    if rule not in STAGE_SPLITS:
        raise BadInputError(
            f"parallel.stage_split must be one of {', '.join(STAGE_SPLITS)}, got {rule!r}."
        )
    if stages > n_blocks:
        raise BadInputError(
            f"{stages} pipeline stages (parallel.pp × parallel.virtual_stages) cannot each "
            f"hold one of the model's {n_blocks} blocks (parallel.stage_split {rule}).",
            hint=f"Plan with at most {n_blocks} stages in all.",
        )
    if rule == "memplan":
        return stage_layers(n_blocks, stages)
    sizes = (_torchtitan_2412 if rule == "torchtitan-2412" else _torchtitan_2504)(n_blocks, stages)
    if min(sizes) < 1:
        empty = sizes.index(min(sizes))
        raise BadInputError(
            f"parallel.stage_split {rule} gives pipeline stage {empty} of {stages} no block "
            f"of the model's {n_blocks} (blocks per stage: {sizes}).",
            hint="Plan with fewer stages, or with parallel.stage_split memplan.",
        )
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return tuple(out)


def split_fits(n_blocks: int, stages: int, rule: StageSplit) -> bool:
    """Whether ``rule`` gives each of ``stages`` pipeline stages a block of ``n_blocks``
    (``split_stages`` does not refuse it)."""
    try:
        return bool(split_stages(n_blocks, stages, rule))
    except BadInputError:
        return False


def in_flight(parallel: Parallel, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations pipeline stage ``stage`` (0-based rank in the
    pipeline) holds at its peak under the schedule, with ``micro_batches`` per step:
    GPipe runs every forward before any backward (all ``m``); 1F1B warms up with
    ``pp − stage`` forwards before its first backward (Narayanan et al. 2021, PipeDream-
    Flush; torch.distributed.pipelining ``Schedule1F1B``); interleaved 1F1B with ``v``
    virtual stages holds ``(pp − stage − 1)·2 + (v − 1)·pp + 1`` forwards of chunk size one
    stage (torch's ``ScheduleInterleaved1F1B`` warm-up), each a ``1/v`` share of the rank's
    layers. Capped by ``m``."""
    if parallel.pp == 1:
        return 1
    m = micro_batches
    if parallel.schedule == "gpipe":
        return m
    if parallel.schedule == "1f1b":
        return min(m, parallel.pp - stage)
    v = parallel.virtual_stages
    warmup = (parallel.pp - stage - 1) * 2 + (v - 1) * parallel.pp + 1
    return min(m * v, warmup)


def pipeline_refusal_by_kind(model: str, hf_blocks: tuple[str, ...] | list[str]) -> str | None:
    """Why memplan cannot run ``model`` in pipeline stages, judged by its kind, or None when
    it may. memplan's runtime splits a model into stages by the pipeline plan of a Hugging
    Face decoder for causal language modelling (``memplan.run.pipeline.pipeline_refusal``,
    which the probe records as ``Profile.pipeline_refused``); where that verdict is not
    recorded (a profile written before memplan recorded it, and every plan), the solver and
    ``verify`` ask this of the model's reference and its ``hf_blocks`` (empty for a model
    that is not a transformers model), so that no plan with pipeline stages is offered, or
    run, for a model that is not one."""
    what = "memplan splits pipeline stages of Hugging Face decoder models only (by their "
    what += "pipeline plan: embeddings, layers, norm, head)"
    if not hf_blocks:
        return f"{what}; {model} is not a Hugging Face transformers model"
    if model.startswith("hf:"):
        query = model.partition("?")[2]
        task = dict(part.partition("=")[::2] for part in query.split("&") if part).get("task")
        if task is not None and task != "causal-lm":
            return f"{what}; {model} is a {task} model, not a causal-LM decoder"
    return None


def float8_layout_refusal(plan: Any) -> str | None:
    """Why memplan's own runtime cannot run ``plan`` (a ``Plan``) as predicted: float8
    linears under tensor, pipeline or context parallel degrees, which ``build_layout``
    shards as plain linears (the scripts and verify convert float8 linears under DDP, ZeRO-1
    and FSDP only). None for any other plan. Said by the emitted scripts and by verify."""
    layout = getattr(plan, "parallel", None)
    if getattr(plan, "float8", None) is None or layout is None:
        return None
    if max(layout.tp, layout.pp, layout.cp) == 1:
        return None
    return (
        f"memplan converts float8 linears under DDP, ZeRO-1 and FSDP only, and its tensor and "
        f"pipeline parallel code would train them in {plan.precision}, not as predicted"
    )
