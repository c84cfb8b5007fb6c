"""Per-rank memory of a parallel layout (issue 25): tensor, sequence, pipeline and context
parallel on top of the data-parallel model. No torch.

The probe measured one process holding the whole model. A rank of a layout holds one
pipeline stage's blocks (``Parallel.stage_ranges``; the embeddings on the first
stage, the final norm, head and loss on the last), each block's TP-split parameters divided
by ``tp`` and its activations scaled by the block's measured factor::

    f_j = ((1 − r_j) + r_j / tp) / cp        r_j = Layer.tp_saved_fraction (measured, TP 2)
    f_j = (1/tp + g_j·(1 − 1/tp)) / cp         with sequence parallel: the norm/residual
                                               region is split by sequence too, but each of
                                               the block's two TP regions (attention, MLP)
                                               saves its all-gathered input whole,
                                               g_j = 2·output_j / saved_j (per sample)
    params_j(rank) = params_j − tp_sharded_bytes_j · (1 − 1/tp)   (grads, optimizer alike)
    kept_j(rank) = kept_j · ((1 − s_j) + s_j / tp)   selective keeps kept_j = saved_j −
                   selective_savings_j; s_j = Layer.tp_selective_fraction (no SP/CP)

``rank_profile`` rewrites the profile as that rank's own: its blocks and fixed parts, its
state, and every timeline point of its blocks re-based, for a point of segment ``(h, ·)``::

    point' = state'(phase, h) + Σ_{a ≤ j < h} f_j·saved_j + f_h·rest + in_flight
    rest   = point − state(phase, h) − Σ_{j < h} saved_j     (the active block's own bytes)
    in_flight = (k − 1)·Σ_{j in stage} f_j·saved_j + m·(input_a·[stage > 0] + output_z·[not last])
                + [gradients resident]·(m − 1)·input_a·[stage > 0]

with ``k`` the micro-batches the stage holds under the schedule (``memplan.parallel.in_flight``;
1F1B: ``pp − stage``; GPipe: all), ``m`` the micro-batches per step, ``input_a`` the hidden
state a later stage receives from the one before and ``output_z`` the one it sends:
torch.distributed.pipelining's receive buffers, one per micro-batch, and the received
inputs' gradients (``pipeline_buffers``). A checkpointed block frees its savings in each of
the ``k`` micro-batches, so its savings are multiplied by ``k``; this is exact at the end of
the forward (every block held) and an over-estimate earlier. The data-parallel dimension is
then the existing per-rank model (memplan.memory.sharding) over ``dp`` ranks, so
``step_peak(rank_profile(...), …, sharding=…)`` is one rank's peak.

Under DDP over TP-split parameters a backward also holds the split gradients of the parts
whose backward has run, apart from DDP's buckets (memory.ddp_tp), added to those segments.

Context parallel's ring attention holds, while a block runs (its forward, and its backward
with any recompute), what torch's ring keeps beside a plain attention call: the gathered K
and V of every cp rank and its fp32 buffers (memplan.memory.ring, measured on gloo ranks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from memplan.devices import DeviceSpec
from memplan.errors import BadInputError
from memplan.memory.activations import activation_factor, freed_inputs, held_bytes, hidden_factor
from memplan.memory.budget import reserve_for
from memplan.memory.ddp_tp import held_split_grads
from memplan.memory.peak import Peak, step_peak
from memplan.memory.pipeline import (
    kept_output_bytes,
    pipeline_buffers,
    rank_times,
    rank_totals,
    stage_output_bytes,
    with_merged_outputs,
)
from memplan.memory.ring import ring_held_slopes
from memplan.memory.sharding import Sharding, rank_float8_bytes
from memplan.memory.terms import grads_at_bytes
from memplan.memory.vocab import (
    LOSS_PART,
    first_stage_part,
    is_head,
    loss_parallel_most,
    loss_parallel_possible,
    loss_parallel_whole_bytes,
    tp_measured,
    vocab_split,
)
from memplan.parallel import Parallel, in_flight
from memplan.plan import Plan, Strategy
from memplan.profile import (
    Affine,
    FixedPart,
    Layer,
    Point,
    Profile,
    Segment,
    affine_scale,
    affine_sub,
    affine_sum,
)


def _state_ratio(params: int, sharded: int, tp: int) -> float:
    """A rank's share of a part's parameters (gradients, optimizer state alike) under TP."""
    if params <= 0 or tp == 1:
        return 1.0
    return (params - sharded * (1.0 - 1.0 / tp)) / params


def _rank_layer(layer: Layer, parallel: Parallel, k: int) -> Layer:
    f = activation_factor(layer, parallel)
    params = layer.params_trainable_bytes + layer.params_frozen_bytes
    r = _state_ratio(params, layer.tp_sharded_bytes, parallel.tp)
    # A fully checkpointed block keeps hidden states only (its input and its output,
    # ``saved − savings``). Without SP/CP a TP rank holds them whole, so its savings lose
    # exactly what the plain run's saved bytes lose; with SP or CP they are split by
    # sequence like the block's input, not by the block's factor ``f`` (which also counts
    # the TP regions' gathered inputs). Selective's kept_j (above): ``f`` with SP or CP.
    s = (layer.tp_selective_fraction or 0.0) if parallel.tp > 1 else 0.0
    split_input = parallel.sequence_parallel or parallel.cp > 1
    input_factor = hidden_factor(parallel)

    def savings(value: Affine | None, hidden: bool, kept_factor: float = 1.0) -> Affine | None:
        if value is None:
            return None
        if not split_input:
            rank = affine_sub(value, affine_scale(layer.saved_bytes, 1.0 - f))
            if kept_factor != 1.0:  # saved·f − kept·kept_factor
                rank = affine_sub(
                    rank, affine_scale(affine_sub(layer.saved_bytes, value), kept_factor - 1.0)
                )
        elif hidden:
            kept = affine_scale(affine_sub(layer.saved_bytes, value), input_factor)
            rank = affine_sub(affine_scale(layer.saved_bytes, f), kept)
        else:
            rank = affine_scale(value, f)
        return affine_scale(rank, k)

    compute = 1.0 / (parallel.tp * parallel.cp)
    return dataclasses.replace(
        layer,
        **_model_state(layer, r),
        input_bytes=affine_scale(layer.input_bytes, input_factor),
        output_bytes=affine_scale(layer.output_bytes, input_factor),
        saved_bytes=affine_scale(layer.saved_bytes, f),
        savings_bytes=savings(layer.savings_bytes, hidden=True),
        selective_savings_bytes=savings(
            layer.selective_savings_bytes, hidden=False, kept_factor=1.0 - s + s / parallel.tp
        ),
        fwd_transient_bytes=affine_scale(layer.fwd_transient_bytes, f),
        bwd_transient_bytes=affine_scale(layer.bwd_transient_bytes, f),
        recompute_transient_bytes=affine_scale(layer.recompute_transient_bytes, f),
        fwd_seconds=affine_scale(layer.fwd_seconds, compute),
        bwd_seconds=affine_scale(layer.bwd_seconds, compute),
        fwd_flops=affine_scale(layer.fwd_flops, compute),
        recompute_seconds=None
        if layer.recompute_seconds is None
        else affine_scale(layer.recompute_seconds, compute),
        selective_recompute_seconds=None
        if layer.selective_recompute_seconds is None
        else affine_scale(layer.selective_recompute_seconds, compute),
        tp_sharded_bytes=math.ceil(layer.tp_sharded_bytes / parallel.tp),
        float8_param_bytes=rank_float8_bytes(layer, parallel.tp),
    )


def _model_state(item: Layer | FixedPart, r: float) -> dict[str, int]:
    """Parameters, gradients and optimizer state on one rank: ``r`` of each, rounded up."""
    names = ("params_trainable_bytes", "params_frozen_bytes", "grad_bytes")
    return {name: math.ceil(getattr(item, name) * r) for name in (*names, "optimizer_state_bytes")}


def _rank_fixed(part: FixedPart, parallel: Parallel) -> FixedPart:
    params = part.params_trainable_bytes + part.params_frozen_bytes
    r = _state_ratio(params, part.tp_sharded_bytes, parallel.tp)
    vocab = parallel.loss_parallel and (is_head(part) or part.name == LOSS_PART)
    saved = 1.0 / parallel.cp / (parallel.tp if vocab else 1)
    return dataclasses.replace(
        part,
        **_model_state(part, r),
        saved_bytes=affine_scale(part.saved_bytes, saved),
        fwd_flops=affine_scale(part.fwd_flops, r),  # a TP-split head's matmul is split with it
        tp_sharded_bytes=math.ceil(part.tp_sharded_bytes / parallel.tp),
        float8_param_bytes=rank_float8_bytes(part, parallel.tp),
    )


@dataclass(frozen=True, slots=True)
class _Frame:
    """How one segment's points move from the whole model to the rank (module docstring)."""

    base_full: int
    base_rank: int
    cur: float
    held_full: Point
    held_rank: Point
    offset: Point
    whole: Point | None = None
    """Loss parallel, after the blocks: the bytes of the rest that stay whole on a TP rank
    (``loss_parallel_whole_bytes``); what exceeds them is the vocabulary's, at most
    loss parallel's most per sample (``lp_most``, the whole run's ``most``, ``vocab_split``),
    times ``vocab``."""
    vocab: float = 1.0
    most: float = math.inf
    lp_most: float = math.inf

    def move(self, point: Point) -> Point:
        rest0 = point[0] - self.base_full - self.held_full[0]
        rest1 = point[1] - self.held_full[1]
        if self.whole is not None:
            rest0 = vocab_split(rest0, self.whole[0], self.vocab)
            rest1 = vocab_split(rest1, self.whole[1], self.vocab, self.most, self.lp_most)
        return (
            self.base_rank + self.held_rank[0] + self.cur * rest0 + self.offset[0],
            self.held_rank[1] + self.cur * rest1 + self.offset[1],
        )


def _shift(point: Point, extra: float, per_sample: float = 0.0) -> Point:
    return (point[0] + extra, point[1] + per_sample)


def _state_bytes(profile: Profile) -> int:
    t = profile.totals
    return (
        t.params_trainable_bytes + t.params_frozen_bytes + t.buffer_bytes + t.optimizer_state_bytes
    )


def _keeps_segment(seg: Segment, stage: range, first: bool, last: bool, n: int) -> bool:
    h = seg.held
    if seg.active != "none":
        return h in stage
    return (first and h == 0) or (last and h == n) or (stage.start < h < stage.stop)


def stage_of_rank(parallel: Parallel, rank: int) -> int:
    """The pipeline stage of global ``rank``, with torchtitan's mesh order
    ``(pp, dp_replicate, dp_shard, cp, tp)`` (tp innermost: ranks ``0..tp-1`` share a
    stage and a batch)."""
    if not 0 <= rank < parallel.world_size:
        raise ValueError(f"rank {rank} is not in a world of {parallel.world_size}")
    return rank // (parallel.world_size // parallel.pp)


def check_layout(profile: Profile, parallel: Parallel) -> None:
    """Refuse a layout the profile cannot describe, saying what to do."""
    n = len(profile.layers)
    if parallel.stages > max(n, 1):
        raise BadInputError(
            f"pipeline of {parallel.stages} stages, but the model has {n} repeated blocks "
            "to split into stages.",
            hint="Use a pipeline degree (× virtual stages) of at most the number of blocks.",
        )
    if parallel.pp > 1 and profile.pipeline_refused:
        raise BadInputError(
            f"pipeline stages (pp {parallel.pp}): {profile.pipeline_refused}",
            hint="Plan with --pp 1 (memplan verify and the emitted scripts would refuse it).",
        )
    if parallel.tp > 1 and profile.tp_refused:
        raise BadInputError(
            f"tensor parallelism (tp {parallel.tp}): {profile.tp_refused}",
            hint="Plan with --tp 1, or add TP_PLAN to the model file (module-name patterns "
            "to colwise/rowwise).",
        )
    if parallel.tp > 1 and not tp_measured(profile):
        raise BadInputError(
            f"the profile of {profile.model.spec} has no tensor-parallel measurement, so "
            "memplan cannot tell which bytes TP divides.",
            hint="Probe the model again (memplan probe, --device cpu or meta: no flag needed): "
            "a model with a TP plan is measured under TP 2 on a fake process group. A model "
            "has one when its transformers config declares base_model_tp_plan (Llama, Qwen2, "
            "Mistral, …) or its model file defines TP_PLAN or tp_plan(model) (module-name "
            "patterns to colwise/rowwise). Or plan with --tp 1.",
        )
    if parallel.loss_parallel and not loss_parallel_possible(profile):
        raise BadInputError(
            f"loss parallel keeps the logits sharded by vocabulary, but the TP plan of "
            f"{profile.model.spec} does not split its head.",
            hint="Add the head (e.g. 'lm_head': 'colwise_gather_output') to the model's "
            "TP_PLAN and probe again, or plan without loss parallel.",
        )


def stage_blocks(n: int, parallel: Parallel, stage: int) -> tuple[range, tuple[int, ...]]:
    """The blocks ``rank_profile`` models for pipeline rank ``stage`` (a contiguous run) and
    the rank's own blocks, in the same order. Interleaved 1F1B gives a rank ``v`` chunks
    that are not contiguous; they are modelled as one run of as many blocks, ending the
    model on the last rank (exact for identical blocks, the case interleaving is for): the
    run's ``i``-th block stands in for the rank's ``i``-th own block."""
    chunks = parallel.stage_ranges(n)
    mine = [chunks[stage + v * parallel.pp] for v in range(parallel.virtual_stages)]
    first, last = stage == 0, stage == parallel.pp - 1
    count = sum(len(chunk) for chunk in mine)
    start = n - count if last else mine[0].start
    if not first and not last:
        start = min(start, n - count)
    return range(start, start + count), tuple(j for chunk in mine for j in chunk)


def stage_checkpoint(
    profile: Profile, parallel: Parallel, stage: int, checkpoint: Mapping[str, str]
) -> dict[str, str]:
    """A plan's checkpoint modes for the blocks of pipeline rank ``stage``, under the names
    ``rank_profile`` gives them (the stand-in run's, with interleaving)."""
    names = profile.layer_names
    run, own = stage_blocks(len(names), parallel, stage)
    return {
        names[j]: checkpoint[names[o]]
        for j, o in zip(run, own, strict=True)
        if names[o] in checkpoint
    }


def own_checkpoint(
    profile: Profile, parallel: Parallel, stage: int, checkpoint: Mapping[str, str]
) -> dict[str, str]:
    """The inverse of ``stage_checkpoint``: a stage solve's modes (stand-in names) under the
    names of the rank's own blocks, so a plan's ``checkpoint:`` covers every block."""
    names = profile.layer_names
    run, own = stage_blocks(len(names), parallel, stage)
    return {
        names[o]: checkpoint[names[j]]
        for j, o in zip(run, own, strict=True)
        if names[j] in checkpoint
    }


def _mode_savings(layer: Layer, mode: str) -> Affine:
    """One micro-batch's savings of a rank's block in ``mode`` (offload frees what full
    checkpointing frees, memplan.modes)."""
    value = layer.selective_savings_bytes if mode == "selective" else layer.savings_bytes
    return value if value is not None else Affine.zero()


def rank_profile(
    profile: Profile,
    parallel: Parallel,
    stage: int,
    micro_batches: int,
    modes: Mapping[str, str] | None = None,
) -> Profile:
    """One rank of pipeline stage ``stage`` (0-based) as a profile of its own (see the
    module docstring), for ``micro_batches`` pipeline micro-batches per step. With
    interleaved 1F1B the rank's ``virtual_stages`` chunks are taken together.

    ``modes`` (the rank's blocks by ``rank_profile``'s names, ``stage_checkpoint``): the
    micro-batches waiting in the pipeline keep only what each block's mode keeps, and the
    profile is exact for that checkpoint map. Without it (the layout search, which does
    not know the map yet) a waiting micro-batch is charged its un-checkpointed bytes less
    the savings of the blocks the current one holds: never less than with ``modes``."""
    check_layout(profile, parallel)
    n = len(profile.layers)
    first, last = stage == 0, stage == parallel.pp - 1
    stage_range, _ = stage_blocks(n, parallel, stage)
    forwards = in_flight(parallel, stage, micro_batches)
    k = max(1, math.ceil(forwards / parallel.virtual_stages))
    # Later micro-batches' backwards (gradients resident) start with one fewer in flight
    # each time the pipeline drains: at most min(k, m − 1) (1F1B's B_1 with m = pp).
    k_resident = max(1, min(k, micro_batches - 1))
    ks = {"no_grads": k, "grads_resident": k_resident}
    # A checkpointed block frees its savings in each held micro-batch; the fewer of the two
    # phases' counts is taken (never more saved than there is).
    k_savings = 1 if modes is not None else min(ks.values())
    layers = [_rank_layer(profile.layers[j], parallel, k_savings) for j in stage_range]
    fixed = [
        _rank_fixed(part, parallel)
        for part in profile.fixed
        if (first and first_stage_part(part)) or (last and not first_stage_part(part))
    ]
    totals = rank_totals(profile, layers, fixed)
    f = [activation_factor(layer, parallel) for layer in profile.layers]
    input_factor = hidden_factor(parallel)
    # What a block adds to a micro-batch's held bytes: the whole model's (its saved bytes
    # less the input the plain step frees after it) and the rank's (``held_bytes``).
    freed = freed_inputs(profile)
    saved = [affine_sub(layer.saved_bytes, freed[j]) for j, layer in enumerate(profile.layers)]
    rank_saved = held_bytes(profile, parallel, stage_range, freed)
    stage_saved = affine_sum(*(rank_saved[j] for j in stage_range))
    if modes is not None:  # each waiting micro-batch keeps only what the modes keep
        names = profile.layer_names
        for j, layer in zip(stage_range, layers, strict=True):
            if names[j] in modes:
                stage_saved = affine_sub(stage_saved, _mode_savings(layer, modes[names[j]]))
    # the ring's buffers while a block runs: forward, and backward (recompute included)
    ring_fwd, ring_bwd = ring_held_slopes(profile, profile.layers[stage_range.start], parallel)
    ring = {"none": 0.0, "fwd": ring_fwd, "bwd": ring_bwd}
    kept = stage_output_bytes(profile, parallel) if last and parallel.pp > 1 else Affine.zero()
    buffers, input_grads = pipeline_buffers(profile, parallel, stage, micro_batches)
    buffers = affine_scale(buffers, input_factor)
    input_grads = affine_scale(input_grads, input_factor)
    # The outputs an engine version keeps (``kept_output_bytes``): with ``k`` micro-batches
    # in flight while gradients are resident, ``m − k`` have finished (1F1B: the last point
    # with ``k`` in flight comes once every forward has run); none before the first backward.
    finished, merged = kept_output_bytes(profile, parallel, stage)
    done = {"no_grads": 0, "grads_resident": max(micro_batches - k_resident, 0)}
    offsets = {}
    for phase, held in ks.items():
        extra = affine_sum(
            buffers,
            affine_scale(finished, done[phase]),
            input_grads if phase == "grads_resident" else Affine.zero(),
        )
        offsets[phase] = (
            (held - 1) * stage_saved.intercept + held * kept.intercept + extra.intercept,
            (held - 1) * stage_saved.slope + held * kept.slope + extra.slope,
        )
    # Prefix sums of the plain saved bytes (whole model) and of the rank's (this stage).
    full_prefix = [(0.0, 0.0)]
    rank_prefix = [(0.0, 0.0)]
    for j in range(n):
        full_prefix.append(
            (full_prefix[-1][0] + saved[j].intercept, full_prefix[-1][1] + saved[j].slope)
        )
        mine = rank_saved.get(j, Affine.zero())
        rank_prefix.append((rank_prefix[-1][0] + mine.intercept, rank_prefix[-1][1] + mine.slope))
    kept = {
        phase: [
            (i, seg)
            for i, seg in enumerate(segments)
            if _keeps_segment(seg, stage_range, first, last, n)
        ]
        for phase, segments in profile.timeline.items()
    }
    moved = {
        phase: tuple(dataclasses.replace(seg, held=seg.held - stage_range.start) for _, seg in rows)
        for phase, rows in kept.items()
    }
    state_full = _state_bytes(profile)
    lp_whole = loss_parallel_whole_bytes(profile)
    whole = (lp_whole.intercept, lp_whole.slope)
    most, lp_most = loss_parallel_most(profile, lp_whole) if parallel.loss_parallel else (0.0, 0.0)
    draft = dataclasses.replace(
        profile,
        layers=tuple(layers),
        fixed=tuple(fixed),
        totals=totals,
        timeline=moved,
        seq=None,
        deduplicated_layers=(),
    )
    state_rank = _state_bytes(draft)
    timeline: dict[str, tuple[Segment, ...]] = {}
    for phase, rows in kept.items():
        out = []
        split = held_split_grads(profile, parallel, stage_range, last, profile.timeline[phase])
        for new_index, (i, seg) in enumerate(rows):
            base_full = state_full + grads_at_bytes(profile, phase, i)
            base_rank = state_rank + grads_at_bytes(draft, phase, new_index)
            h = seg.held
            cur = f[h] if seg.active != "none" else 1.0 / parallel.cp
            after_blocks = seg.active == "none" and h == n
            frame = _Frame(
                base_full,
                base_rank,
                cur,
                full_prefix[h],
                rank_prefix[h],
                _shift(offsets.get(phase, offsets["no_grads"]), split[i], ring[seg.active]),
                whole if after_blocks and parallel.loss_parallel else None,
                1.0 / parallel.tp,
                most,
                lp_most,
            )
            out.append(
                dataclasses.replace(
                    moved[phase][new_index],
                    points=tuple(frame.move(p) for p in seg.points),
                    ckpt_points=tuple(frame.move(p) for p in seg.ckpt_points),
                    selective_points=tuple(frame.move(p) for p in seg.selective_points),
                )
            )
        timeline[phase] = tuple(out)
    ratio = (state_rank + totals.grad_bytes) / max(state_full + profile.totals.grad_bytes, 1)
    optimizer = affine_scale(profile.optimizer_step_peak_bytes, ratio)
    rank = dataclasses.replace(
        draft,
        timeline=timeline,
        **rank_times(profile, fixed, ratio),
        # the schedule's buffers, the inputs' gradients and kept outputs outlive the step
        optimizer_step_peak_bytes=affine_sum(
            optimizer, buffers, input_grads, affine_scale(finished, micro_batches)
        ),
    )
    return with_merged_outputs(rank, affine_scale(merged, micro_batches))


# --------------------------------------------------------------------------- a plan's peaks
def layout_sharding(
    strategy: Strategy, parallel: Parallel, grad_sync: str = "last_micro_step"
) -> Sharding:
    """The data-parallel dimension of a layout as the per-rank model sees it: DDP over all
    ``dp`` ranks; a sharded strategy (ZeRO, FSDP) over ``dp_shard × cp`` (HSDP replicates the
    shards ``dp_replicate`` times, which adds no memory). Context-parallel ranks hold the
    same weights, so torchtitan shards them over the two together: it flattens ``dp_shard``
    and ``cp`` into one ``dp_shard_cp`` mesh dimension and applies ``fully_shard`` over it
    (torchtitan 9dec370, torchtitan/parallelisms/parallel_dims.py ``build_mesh`` and
    parallelize_llama.py; the same ``fsdp`` mesh in torchtitan 0.3). A pipeline's replicas
    are not wrapped in DDP (its bucket rebuild cannot wrap a stage): memplan's runtime
    all-reduces each gradient in place after the schedule, so no buckets (world 1 here)."""
    world = parallel.dp if strategy == "ddp" else parallel.dp_shard * parallel.cp
    if strategy == "ddp" and parallel.pp > 1:
        world = 1
    return Sharding(
        strategy=strategy,
        world_size=world,
        grad_sync=grad_sync,
        reshard_after_forward=parallel.pp == 1,
        edge_units=parallel.edge_units,
        reduce_after_schedule=parallel.pp > 1,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePeak:
    """The peak of every rank of one pipeline stage (TP, CP and DP ranks of a stage are
    alike: same blocks, same shares)."""

    stage: int
    layers: tuple[str, ...]
    """The stage's blocks, by fully-qualified name."""
    in_flight: int
    """Micro-batches whose activations the stage holds at its peak (per virtual chunk)."""
    peak: Peak


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutPeaks:
    """Every pipeline stage's predicted peak for a plan, per rank."""

    parallel: Parallel
    stages: tuple[StagePeak, ...]

    @property
    def worst(self) -> StagePeak:
        """The stage with the highest peak (the first of equals)."""
        return max(self.stages, key=lambda s: (s.peak.peak_bytes, -s.stage))

    def rank_peak(self, rank: int) -> Peak:
        """The predicted peak of global ``rank`` (``stage_of_rank`` says its stage)."""
        return self.stages[stage_of_rank(self.parallel, rank)].peak


def communicators(parallel: Parallel) -> int:
    """NCCL communicators a rank of ``parallel`` belongs to: one per dimension of two or
    more ranks (data-parallel replicate and shard, tensor, pipeline, context), the shards'
    spanning ``dp_shard × cp`` (``layout_sharding``)."""
    shards = parallel.dp_shard * parallel.cp
    sizes = (parallel.dp_replicate, shards, parallel.tp, parallel.pp, parallel.cp)
    return sum(1 for size in sizes if size > 1)


def plan_layout(plan: Plan) -> Parallel:
    """The plan's layout; a plan without one is data parallelism over its world size."""
    if plan.parallel is not None:
        return plan.parallel
    if plan.strategy == "ddp":
        return Parallel(dp_replicate=plan.world_size)
    return Parallel(dp_shard=plan.world_size)


def stage_peak(
    profile: Profile,
    plan: Plan,
    stage: int,
    device_spec: DeviceSpec | None = None,
) -> StagePeak:
    """The predicted peak of one rank of pipeline stage ``stage`` under ``plan``."""
    parallel = plan_layout(plan)
    chosen = stage_checkpoint(profile, parallel, stage, plan.checkpoint)
    modes = chosen if parallel.pp > 1 else None
    rank = rank_profile(profile, parallel, stage, plan.accumulation_steps, modes)
    sharding = layout_sharding(plan.strategy, parallel, plan.grad_sync)
    peak = step_peak(
        rank,
        plan.micro_batch_size,
        chosen,
        plan.accumulation_steps,
        reserve=reserve_for(
            rank, device_spec, sharding, communicators(parallel), plan.accumulation_steps
        ),
        sharding=sharding,
    )
    forwards = in_flight(parallel, stage, plan.accumulation_steps)
    return StagePeak(
        stage=stage,
        layers=rank.layer_names,
        in_flight=max(1, math.ceil(forwards / parallel.virtual_stages)),
        peak=peak,
    )


def layout_peaks(
    profile: Profile, plan: Plan, device_spec: DeviceSpec | None = None
) -> LayoutPeaks:
    """Every pipeline stage's peak for ``plan`` (one stage without pipelining), per rank:
    the API ``verify`` compares each rank's measured peak with (``rank_peak(rank)``)."""
    parallel = plan_layout(plan)
    return LayoutPeaks(
        parallel=parallel,
        stages=tuple(stage_peak(profile, plan, s, device_spec) for s in range(parallel.pp)),
    )
