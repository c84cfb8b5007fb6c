"""The step peak and where it is: evaluate every segment of every phase of one optimizer step,
break the peak into its terms and describe its place. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memplan.memory.budget import NO_RESERVE, Reserve
from memplan.memory.sharding import (
    SINGLE,
    Sharding,
    bucket_views_replace_grads,
    ddp_bucket_bytes,
    fsdp_gathered_bytes,
    optimizer_adjust_bytes,
    rank_optimizer_state_bytes,
    rank_params_bytes,
    rank_state_bytes,
    segment_adjust_bytes,
    sharded_grads_removed_bytes,
    zero2_bucket_bytes,
)
from memplan.memory.terms import (
    _NO_BOUND,
    OPTIMIZER_STEP,
    PHASE_GRADS_RESIDENT,
    Checkpointed,
    _backward_started,
    grads_at_bytes,
    held_mode_prefix_bytes,
    layer_modes,
    mode_of,
    optimizer_step_peak_bytes,
    phases_for,
    segment_points_bytes,
)
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


def micro_step_peak_bytes(
    profile: Profile,
    phase: Phase,
    micro_batch: int,
    checkpointed: frozenset[int] | Mapping[int, str],
    *,
    sharding: Sharding = SINGLE,
    accumulation_steps: int = 1,
) -> tuple[int, int | None]:
    """Peak over one phase's segments and the index of the (first) segment reaching it,
    for one rank under ``sharding`` (``segment_adjust_bytes``). ``checkpointed``: a set
    (full checkpointing) or a mapping of layer index to mode."""
    held = held_mode_prefix_bytes(profile, micro_batch, checkpointed)
    n = len(profile.layers)
    best, best_index = _NO_BOUND, None
    for index, segment in enumerate(profile.timeline[phase]):
        # segment_peak_bytes, with the held savings summed once for all segments
        active_mode = mode_of(checkpointed, segment.held) if segment.held < n else KEEP
        top = segment_points_bytes(segment, micro_batch, active_mode)
        value = top - held[segment.held]
        if sharding != SINGLE:
            value += segment_adjust_bytes(profile, sharding, phase, index, accumulation_steps)
        if value > best:
            best, best_index = value, index
    return best, best_index


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
    one process)."""
    chosen = layer_modes(profile, checkpointed)
    places: list[tuple[int, str, int | None]] = []
    for phase_name in phases_for(accumulation_steps):
        value, seg_index = micro_step_peak_bytes(
            profile,
            phase_name,
            micro_batch,
            chosen,
            sharding=sharding,
            accumulation_steps=accumulation_steps,
        )
        if seg_index is not None:
            places.append((value, phase_name, seg_index))
    optimizer = optimizer_step_peak_bytes(profile, micro_batch)
    places.append((optimizer + optimizer_adjust_bytes(profile, sharding), OPTIMIZER_STEP, None))
    best = max(value for value, _, _ in places)
    _, phase, index = next(place for place in places if place[0] == best)  # first place wins
    reserve_bytes = reserve.bytes_for(best)
    return Peak(
        peak_bytes=best + reserve_bytes,
        allocated_bytes=best,
        reserve_bytes=reserve_bytes,
        phase=phase,
        segment_index=index,
        where=describe_peak(profile, phase, index, chosen),
        breakdown=breakdown_at(
            profile,
            phase,
            index,
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
    elif _backward_started(segments, index):
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
