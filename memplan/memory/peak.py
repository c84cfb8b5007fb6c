"""The step peak and where it is: evaluate every segment of every phase of one optimizer step,
break the peak into its terms and describe its place. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from memplan.memory.budget import NO_RESERVE, Reserve
from memplan.memory.rank_adjust import (
    optimizer_adjust_bytes,
    rank_state_bytes,
    segment_adjust_bytes,
)
from memplan.memory.sharding import (
    SINGLE,
    Sharding,
    bucket_views_replace_grads,
    ddp_bucket_bytes,
    fsdp_gathered_bytes,
    fsdp_grads_bytes,
    rank_optimizer_state_bytes,
    rank_params_bytes,
    sharded_grads_removed_bytes,
    zero2_bucket_bytes,
)
from memplan.memory.terms import (
    NO_BOUND,
    OPTIMIZER_STEP,
    PHASE_GRADS_RESIDENT,
    Checkpointed,
    backward_started,
    cast_extra_bytes,
    grads_at_bytes,
    has_autocast_casts,
    held_mode_prefix_bytes,
    layer_modes,
    mode_of,
    optimizer_step_peak_bytes,
    phases_for,
    shared_extra_bytes,
)
from memplan.memory.tops import first_highest_segment, segment_tops_bytes
from memplan.modes import FULL, KEEP, OFFLOAD, SELECTIVE
from memplan.plan import Breakdown
from memplan.profile import Phase, Profile, Segment


# --------------------------------------------------------------------------- step peak
@dataclass(frozen=True, kw_only=True, slots=True)
class Peak:
    """The predicted peak of one optimizer step, where it happens and what holds it."""

    peak_bytes: int
    """Allocated peak plus reserve: what the budget is compared with."""
    allocated_bytes: int
    """Peak of live tensor bytes (what max_memory_allocated would report)."""
    reserve_bytes: int
    phase: str
    """``no_grads``, ``grads_resident`` or ``optimizer_step``."""
    segment_index: int | None
    """Index into ``profile.timeline[phase]``; None for the optimizer step."""
    where: str
    """Human description, e.g. 'backward of h.0 (accumulation micro-step, gradients resident)'."""
    breakdown: Breakdown


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPoint:
    """One point of an optimizer step on one rank: a segment of a phase, or the optimizer
    step (``index`` None)."""

    phase: str
    index: int | None
    allocated_bytes: int


def rank_segments(
    profile: Profile,
    accumulation_steps: int,
    sharding: Sharding = SINGLE,
    phases: Sequence[str] | None = None,
) -> Iterator[tuple[str, int, Segment, int]]:
    """``(phase, index, segment, adjust)`` for every segment of one optimizer step in order
    (``phases``: default all of the step's), with what sharding adds to or removes from the
    measured bytes there on one rank (``segment_adjust_bytes``; 0 for one process). The walk
    that ``step_points`` and ``step_bounds`` share."""
    single = sharding == SINGLE  # once, not once per segment (a dataclass comparison)
    for phase in phases_for(accumulation_steps) if phases is None else phases:
        for index, segment in enumerate(profile.timeline[phase]):
            adjust = (
                0
                if single
                else segment_adjust_bytes(profile, sharding, phase, index, accumulation_steps)
            )
            yield phase, index, segment, adjust


def optimizer_point_bytes(profile: Profile, micro_batch: int, sharding: Sharding = SINGLE) -> int:
    """The optimizer step's allocated peak on one rank."""
    return optimizer_step_peak_bytes(profile, micro_batch) + optimizer_adjust_bytes(
        profile, sharding
    )


def step_points(
    profile: Profile,
    micro_batch: int,
    checkpointed: Checkpointed,
    accumulation_steps: int,
    *,
    sharding: Sharding = SINGLE,
    phases: Sequence[str] | None = None,
) -> list[StepPoint]:
    """The one evaluation of the model: the allocated bytes at every point of one optimizer
    step on one rank, in order. Each segment of each phase is ``peak_segment`` of the module
    docstring (its active layer's points in that layer's mode, less the savings of the
    layers held, each in its mode) plus the rank's adjustment; the optimizer step comes
    last (unless ``phases`` names only some phases). ``step_peak`` is the first highest of
    them and the report draws them all; ``step_bounds`` regroups the same walk by held layer
    for the solver, and the tests prove it equal to this to the byte."""
    return [
        StepPoint(phase=phase, index=index, allocated_bytes=allocated)
        for phase, index, allocated in _step_values(
            profile, micro_batch, checkpointed, accumulation_steps, sharding, phases
        )
    ]


def _step_values(
    profile: Profile,
    micro_batch: int,
    checkpointed: Checkpointed,
    accumulation_steps: int,
    sharding: Sharding = SINGLE,
    phases: Sequence[str] | None = None,
) -> list[tuple[str, int | None, int]]:
    """``step_points`` as plain ``(phase, index, allocated_bytes)`` tuples: the walk itself,
    with each phase's segment tops in each mode taken at once (memory.tops)."""
    chosen = layer_modes(profile, checkpointed)
    held = held_mode_prefix_bytes(profile, micro_batch, chosen)
    n = len(profile.layers)
    used_modes = {KEEP, *chosen.values()}
    tops: dict[tuple[str, str], list[int]] = {}
    values: list[tuple[str, int | None, int]] = []
    if sharding == SINGLE and used_modes == {KEEP}:  # the common case, in one tight loop
        for phase in phases_for(accumulation_steps) if phases is None else phases:
            segments = profile.timeline[phase]
            keep_tops = segment_tops_bytes(segments, micro_batch, KEEP)
            values += [
                (phase, index, top - held[segment.held])
                for index, (segment, top) in enumerate(zip(segments, keep_tops, strict=True))
            ]
    shared = bool(profile.shared_inputs) and used_modes != {KEEP}
    casts = used_modes != {KEEP} and has_autocast_casts(profile)
    for phase, index, segment, adjust in (
        ()
        if sharding == SINGLE and used_modes == {KEEP}
        else rank_segments(profile, accumulation_steps, sharding, phases)
    ):
        if shared:  # memory.terms: a shared input kept by a checkpoint, once
            adjust += shared_extra_bytes(profile, segment, micro_batch, chosen)
        if casts:  # memory.terms: kept layers' autocast casts beside a checkpoint's backward
            adjust += cast_extra_bytes(profile, segment, chosen)
        if (phase, KEEP) not in tops:
            segments = profile.timeline[phase]
            for m in used_modes:
                tops[(phase, m)] = segment_tops_bytes(segments, micro_batch, m)
        h = segment.held
        mode = chosen.get(h, KEEP) if h < n else KEEP
        values.append((phase, index, tops[(phase, mode)][index] - held[h] + adjust))
    if phases is None:
        values.append((OPTIMIZER_STEP, None, optimizer_point_bytes(profile, micro_batch, sharding)))
    return values


def micro_step_peak_bytes(
    profile: Profile,
    phase: Phase,
    micro_batch: int,
    checkpointed: frozenset[int] | Mapping[int, str],
    *,
    sharding: Sharding = SINGLE,
    accumulation_steps: int = 1,
) -> tuple[int, int | None]:
    """Peak over one phase's segments and the index of the (first) segment reaching it, for
    one rank under ``sharding``: a view of ``step_points``. ``checkpointed``: a set (full
    checkpointing) or a mapping of layer index to mode."""
    points = step_points(
        profile,
        micro_batch,
        checkpointed,
        accumulation_steps,
        sharding=sharding,
        phases=(phase,),
    )
    if not points:
        return NO_BOUND, None
    best = max(p.allocated_bytes for p in points)
    return best, next(p.index for p in points if p.allocated_bytes == best)


def step_peak(
    profile: Profile,
    micro_batch: int,
    checkpointed: Checkpointed,
    accumulation_steps: int,
    *,
    reserve: Reserve = NO_RESERVE,
    sharding: Sharding = SINGLE,
) -> Peak:
    """The predicted peak of one optimizer step with ``accumulation_steps`` micro-steps of
    ``micro_batch`` samples, checkpointing ``checkpointed`` (layer indices or names: full
    checkpointing; or a mapping of them to modes), on one rank under ``sharding`` (default:
    one process): the first highest of ``step_points``, with its place and breakdown."""
    chosen = layer_modes(profile, checkpointed)
    found = None
    # the walk in array operations (memory.tops), when it can be: one process, and no
    # shared input that a checkpoint keeps (added segment by segment in _step_values)
    if sharding == SINGLE and (
        not chosen or (not profile.shared_inputs and not has_autocast_casts(profile))
    ):
        found = first_highest_segment(
            profile.timeline,
            phases_for(accumulation_steps),
            micro_batch,
            chosen,
            held_mode_prefix_bytes(profile, micro_batch, chosen),
        )
    if found is not None:
        best, top_phase, top_index = found
        optimizer = optimizer_point_bytes(profile, micro_batch, sharding)
        if optimizer > best:  # the optimizer step comes last: it wins only by more
            best, top_phase, top_index = optimizer, OPTIMIZER_STEP, None
    else:
        values = _step_values(profile, micro_batch, chosen, accumulation_steps, sharding)
        best = max(value[2] for value in values)
        top_phase, top_index, _ = next(v for v in values if v[2] == best)  # the first wins
    reserve_bytes = reserve.bytes_for(best)
    return Peak(
        peak_bytes=best + reserve_bytes,
        allocated_bytes=best,
        reserve_bytes=reserve_bytes,
        phase=top_phase,
        segment_index=top_index,
        where=describe_peak(profile, top_phase, top_index, chosen),
        breakdown=breakdown_at(
            profile,
            top_phase,
            top_index,
            micro_batch,
            chosen,
            best,
            reserve_bytes,
            sharding=sharding,
            accumulation_steps=accumulation_steps,
        ),
    )


# --------------------------------------------------------------------------- breakdown
def _split(total: int, parts: Sequence[int]) -> list[int]:
    """Give each part what it asks for, in order, while ``total`` lasts; the rest is last."""
    out, left = [], total
    for want in parts:
        take = min(max(want, 0), max(left, 0))
        out.append(take)
        left -= take
    out.append(left)
    return out


def activations_at_bytes(
    profile: Profile, segment: Segment, micro_batch: int, checkpointed: frozenset[int]
) -> int:
    """Activation bytes held at a segment: what the held layers keep (their input only when
    checkpointed) plus what the fixed parts save. An estimate; transients are the rest."""
    held = 0
    for j in range(segment.held):
        layer = profile.layers[j]
        kept = layer.saved_bytes.at(micro_batch)
        mode = mode_of(checkpointed, j)
        if mode == SELECTIVE and layer.selective_savings_bytes is not None:
            kept -= layer.selective_savings_bytes.at(micro_batch)
        elif mode != KEEP:
            kept -= layer.savings_bytes.at(micro_batch)
        held += kept
    fixed = sum(part.saved_bytes.at(micro_batch) for part in profile.fixed)
    return max(math.floor(held + fixed), 0)


def breakdown_at(
    profile: Profile,
    phase: str,
    index: int | None,
    micro_batch: int,
    checkpointed: frozenset[int],
    allocated_bytes: int,
    reserve_bytes: int,
    *,
    sharding: Sharding = SINGLE,
    accumulation_steps: int = 1,
) -> Breakdown:
    """Split a peak into params, grads, optimizer, activations, transient and reserve. The
    total is exact; the split between activations, gradients and transients is estimated
    from the per-layer figures (the timeline only knows totals). Per rank: params include
    FSDP's gathered units, grads DDP's or ZeRO-2's buckets."""
    if index is None:
        activations = 0
    else:
        segment = profile.timeline[phase][index]
        activations = activations_at_bytes(profile, segment, micro_batch, checkpointed)
    params = rank_params_bytes(profile, sharding)
    held_grads = grads_at_bytes(profile, phase, index)
    grads = held_grads
    if sharding != SINGLE:
        if index is None:
            grads = rank_state_bytes(profile, sharding)[1]
        else:
            segment = profile.timeline[phase][index]
            params += fsdp_gathered_bytes(profile, sharding, phase, index)
            if sharding.strategy == "fsdp" and sharding.world_size > 1:
                grads = fsdp_grads_bytes(profile, sharding, phase, index, accumulation_steps)
            grads -= sharded_grads_removed_bytes(profile, sharding, held_grads, accumulation_steps)
            grads += ddp_bucket_bytes(profile, sharding) + zero2_bucket_bytes(profile, sharding)
            if ddp_bucket_bytes(profile, sharding) and bucket_views_replace_grads(
                sharding, phase, accumulation_steps
            ):
                grads -= held_grads  # bucket views replace the gradients
    params, optimizer, grads, acts, transient = _split(
        allocated_bytes,
        [params, rank_optimizer_state_bytes(profile, sharding), grads, activations],
    )
    return Breakdown(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=acts,
        transient=transient,
        reserve=reserve_bytes,
    )


# --------------------------------------------------------------------------- where
def describe_segment(
    profile: Profile, phase: str, index: int, checkpointed: frozenset[int] = frozenset()
) -> str:
    """Where a segment is in the step, in words: 'backward of h.3', 'forward after h.11'."""
    segments = profile.timeline[phase]
    segment = segments[index]
    names = profile.layer_names
    h, n = segment.held, len(names)
    mode = mode_of(checkpointed, h) if h < n else KEEP
    if segment.active == "fwd":
        text = (
            f"forward of {names[h]}"
            + {
                KEEP: "",
                FULL: " (checkpointed)",
                SELECTIVE: " (selective checkpoint)",
                OFFLOAD: " (offloaded)",
            }[mode]
        )
    elif segment.active == "bwd":
        text = {
            KEEP: f"backward of {names[h]}",
            FULL: f"recompute and backward of {names[h]}",
            SELECTIVE: f"selective recompute and backward of {names[h]}",
            OFFLOAD: f"backward of {names[h]} (offloaded tensors back)",
        }[mode]
    elif n == 0:
        text = "micro-step"
    elif h == n:
        text = f"head and loss after {names[-1]}"
    elif backward_started(segments, index):
        text = (
            f"backward after {names[0]}"
            if h == 0
            else f"backward between {names[h]} and {names[h - 1]}"
        )
    else:
        text = (
            f"forward before {names[0]}"
            if h == 0
            else f"forward between {names[h - 1]} and {names[h]}"
        )
    if phase == PHASE_GRADS_RESIDENT:
        text += " (accumulation micro-step, gradients resident)"
    return text


def describe_peak(
    profile: Profile, phase: str, index: int | None, checkpointed: frozenset[int] = frozenset()
) -> str:
    if index is None:
        return "optimizer step"
    return describe_segment(profile, phase, index, checkpointed)
