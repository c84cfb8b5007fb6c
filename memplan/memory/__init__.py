"""The peak-memory model: how many bytes one optimizer step needs, and where it peaks.

Reads a :class:`memplan.profile.Profile` (see its module docstring for the timeline of
segments) and nothing else; no torch. One small function per term. The model
(docs/design.md, "The memory model")::

    peak_segment(b, C) = max(points(b) if active layer not in C else ckpt_points(b))
                         - sum(savings_j(b) for j < held if j in C)
    micro-step peak    = max over the segments of one phase
    step peak (k = 1)  = max(no_grads, optimizer_step)
    step peak (k >= 2) = max(no_grads, grads_resident, optimizer_step)
    predicted peak     = step peak + reserve          (reserve: CUDA context + allocator)

Timeline points are *absolute* live bytes (parameters, optimizer state and gradients
included), as the probe's tracker counts them; the breakdown splits a peak into its terms.

Per rank, with more than one data-parallel rank (``Sharding``; see memplan.memory.sharding),
the same timeline is used with a per-segment *adjustment*: the probe measured one process
holding everything, so a rank's live bytes at a point are the measured bytes, less the
resident state that sharding removes there, plus the buffers the engine adds there
(gradient buckets, all-gathered units, reduce-scatter inputs). The adjustment depends on the
phase and the segment only, never on the checkpoint set, so the solver stays exact.

Bytes are whole numbers here: a live-byte point is rounded up and a saving rounded down, so
every prediction is an integer, never below the fitted value, and the solver (which sums
the same integers in another order) agrees with this module to the byte.

The package, one job per module: ``budget`` (reserve, margin, allocated limit), ``terms``
(one process's terms and segments), ``sharding`` (per-rank terms), ``peak`` (the step peak,
its breakdown and place) and ``bounds`` (the step as bounds for the solver).
"""

from memplan.memory.bounds import (
    StepBounds,
    bounds_peak_bytes,
    feasible_floor_bytes,
    fits_somehow,
    host_total_bytes,
    min_allocated_bytes,
    plan_peak,
    prefix_saving_bounds,
    step_bounds,
)
from memplan.memory.budget import (
    DEFAULT_CONTEXT_BYTES,
    DEFAULT_FRAGMENTATION_FRACTION,
    DEFAULT_MARGIN,
    NO_RESERVE,
    Reserve,
    allocated_limit_bytes,
    budget_for_peak_bytes,
    margin_problem,
    plans_for_cuda,
    reserve_for,
    usable_budget_bytes,
)
from memplan.memory.peak import (
    Peak,
    StepPoint,
    activations_at_bytes,
    breakdown_at,
    describe_peak,
    describe_segment,
    micro_step_peak_bytes,
    optimizer_point_bytes,
    rank_segments,
    step_peak,
    step_points,
)
from memplan.memory.rank_adjust import (
    optimizer_adjust_bytes,
    rank_state_bytes,
    segment_adjust_bytes,
)
from memplan.memory.sharding import (
    MASTER_ELEMENT_BYTES,
    SINGLE,
    Sharding,
    bucket_views_replace_grads,
    ddp_bucket_bytes,
    element_bytes,
    fsdp_gathered_bytes,
    fsdp_grads_bytes,
    fsdp_sharded_grads_bytes,
    fsdp_shards_resident,
    gathered_params_bytes,
    gathered_root_bytes,
    gathered_unit_bytes,
    master_bytes,
    master_element_bytes,
    mixed_precision_params,
    optimizer_transient_bytes,
    rank_optimizer_state_bytes,
    rank_params_bytes,
    root_params_bytes,
    shard_bytes,
    sharded_grads_removed_bytes,
    sharding_for,
    syncs_every_micro_step,
    unit_params_bytes,
    zero2_bucket_bytes,
)
from memplan.memory.terms import (
    OPTIMIZER_STEP,
    PHASE_GRADS_RESIDENT,
    PHASE_NO_GRADS,
    Checkpointed,
    affine_bytes,
    available_modes,
    grads_at_bytes,
    grads_bytes,
    has_selective,
    held_mode_prefix_bytes,
    held_savings_bytes,
    held_savings_prefix_bytes,
    layer_indices,
    layer_modes,
    mode_of,
    mode_savings_bytes,
    offload_host_bytes,
    optimizer_state_bytes,
    optimizer_step_peak_bytes,
    params_bytes,
    phases_for,
    point_bytes,
    savings_bytes,
    segment_peak_bytes,
    segment_points_bytes,
)

__all__ = [
    "DEFAULT_CONTEXT_BYTES",
    "DEFAULT_FRAGMENTATION_FRACTION",
    "DEFAULT_MARGIN",
    "MASTER_ELEMENT_BYTES",
    "NO_RESERVE",
    "OPTIMIZER_STEP",
    "PHASE_GRADS_RESIDENT",
    "PHASE_NO_GRADS",
    "SINGLE",
    "Checkpointed",
    "Peak",
    "Reserve",
    "Sharding",
    "StepBounds",
    "StepPoint",
    "activations_at_bytes",
    "affine_bytes",
    "allocated_limit_bytes",
    "available_modes",
    "bounds_peak_bytes",
    "breakdown_at",
    "bucket_views_replace_grads",
    "budget_for_peak_bytes",
    "ddp_bucket_bytes",
    "describe_peak",
    "describe_segment",
    "element_bytes",
    "feasible_floor_bytes",
    "fits_somehow",
    "fsdp_gathered_bytes",
    "fsdp_grads_bytes",
    "fsdp_sharded_grads_bytes",
    "fsdp_shards_resident",
    "gathered_params_bytes",
    "gathered_root_bytes",
    "gathered_unit_bytes",
    "grads_at_bytes",
    "grads_bytes",
    "has_selective",
    "held_mode_prefix_bytes",
    "held_savings_bytes",
    "held_savings_prefix_bytes",
    "host_total_bytes",
    "layer_indices",
    "layer_modes",
    "margin_problem",
    "master_bytes",
    "master_element_bytes",
    "micro_step_peak_bytes",
    "min_allocated_bytes",
    "mixed_precision_params",
    "mode_of",
    "mode_savings_bytes",
    "offload_host_bytes",
    "optimizer_adjust_bytes",
    "optimizer_point_bytes",
    "optimizer_state_bytes",
    "optimizer_step_peak_bytes",
    "optimizer_transient_bytes",
    "params_bytes",
    "phases_for",
    "plan_peak",
    "plans_for_cuda",
    "point_bytes",
    "prefix_saving_bounds",
    "rank_optimizer_state_bytes",
    "rank_params_bytes",
    "rank_segments",
    "rank_state_bytes",
    "reserve_for",
    "root_params_bytes",
    "savings_bytes",
    "segment_adjust_bytes",
    "segment_peak_bytes",
    "segment_points_bytes",
    "shard_bytes",
    "sharded_grads_removed_bytes",
    "sharding_for",
    "step_bounds",
    "step_peak",
    "step_points",
    "syncs_every_micro_step",
    "unit_params_bytes",
    "usable_budget_bytes",
    "zero2_bucket_bytes",
]
