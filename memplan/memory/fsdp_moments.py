"""FSDP2's gradient moments, per unit (memplan.memory.sharding.fsdp_grads_bytes): a unit's
gradients in each form (``UnitGrads``), and what its ``post_backward``, torchtitan's tail
unit inside a chunked loss, and a pipeline stage's end-of-schedule reduction hold at their
highest moments. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UnitGrads:
    """One FSDP unit's gradients, in bytes: as the probe computed them (``probed``, the
    compute dtype), unsharded in ``reduce_dtype`` (``whole``), the reduce-scatter input
    (``scatter_input``: padded to a multiple of the world size) and one rank's shard."""

    probed: int
    whole: int
    scatter_input: int
    shard: int


def tail_reduced_in_forward(tail: UnitGrads) -> int:
    """What torchtitan's norm + head unit adds inside a loss that runs its own backward in
    the forward (``Profile.ddp_refused``: a chunked loss): its ``post_backward`` reduce-
    scatters there, its reduce-scatter input and output beside its accumulated gradient.
    The probe's loss region already holds, at its last chunk's accumulation, a fresh chunk
    gradient of the head beside the accumulated one, which FSDP2's moment does not: so the
    moment is at most that region's top plus input and output less one gradient. Traced op
    by op on torchtitan 0.3.0, FSDP 2, vocabulary 32768 (bench engines, chunked row): the
    unit's ``chunk_cat`` input (33.5 MB) and ``_reduce_scatter_base_`` output (16.8 MB)
    after the last chunk's ``add_``, the rank's peak."""
    return max(tail.scatter_input + tail.shard - tail.probed, 0)


def reduce_after_schedule_moments(held: int, units: list[UnitGrads]) -> list[int]:
    """The pipeline schedule's reduction after the backward (``Sharding.
    reduce_after_schedule``), from ``held`` (every unit's gradients whole): each unit in
    turn drops the previous unit's reduce-scatter input (``reduce_scatter_max_input_buffers``
    = 1, reclaimed before the next reduce), copies its gradients into its own, frees them
    and keeps the input, its output the rank's shard."""
    moments = []
    for unit in units:
        moments.append(held + unit.scatter_input)
        held += unit.shard - unit.whole
        moments.append(held + unit.scatter_input)
    return moments


def reduce_output_bytes(unit: UnitGrads) -> int:
    """Live while a unit's reduce-scatter runs: its input and its output (the shard)."""
    return unit.scatter_input + unit.shard


def post_backward_moments(
    steady: int,
    unit: UnitGrads,
    syncing: bool,
    sharded_before: bool,
    resident: bool,
    mixed: bool,
) -> list[int]:
    """Gradient bytes at the peaks of one unit's ``post_backward``, given ``steady``, what
    is held after it (its shard and kept input, or its unsharded gradients)."""
    if not syncing:  # upcast next to the compute-dtype gradients
        return [steady + unit.probed] if mixed else []
    new_shard = 0 if sharded_before else unit.shard
    before = steady - new_shard - unit.scatter_input
    unsharded = unit.whole if resident and not sharded_before else unit.probed
    return [before + unsharded + unit.scatter_input, before + reduce_output_bytes(unit)]
