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

Per rank, with more than one data-parallel rank (``Sharding``; see "per-rank terms" below),
the same timeline is used with a per-segment *adjustment*: the probe measured one process
holding everything, so a rank's live bytes at a point are the measured bytes, less the
resident state that sharding removes there, plus the buffers the engine adds there
(gradient buckets, all-gathered units, reduce-scatter inputs). The adjustment depends on the
phase and the segment only, never on the checkpoint set, so the solver stays exact.

Bytes are whole numbers here: a live-byte point is rounded up and a saving rounded down, so
every prediction is an integer, never below the fitted value, and the solver (which sums
the same integers in another order) agrees with this module to the byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from memplan.devices import DeviceSpec
from memplan.errors import BadInputError
from memplan.modes import FULL, KEEP, MODES, OFFLOAD, SELECTIVE
from memplan.plan import GRAD_SYNCS, STRATEGIES, Breakdown, GradSync, Plan, Strategy
from memplan.profile import Affine, Phase, Point, Profile, Segment
from memplan.units import MiB

# With no measurement, the CUDA context (driver state, cuBLAS/cuDNN kernels and workspaces
# loaded by PyTorch) takes a few hundred MiB: about 300-600 MiB on A100/H100 with CUDA 12
# lazy loading, as nvidia-smi shows for a process that has run one matmul and one conv.
# 512 MiB is the conservative middle of that range.
DEFAULT_CONTEXT_BYTES = 512 * MiB
# PyTorch's caching allocator rounds blocks up (to 512 B, and 2 MiB segments for large
# tensors) and fragments: max_memory_reserved typically exceeds max_memory_allocated by a
# few percent in steady training. 5% of the allocated peak covers the usual case.
DEFAULT_FRAGMENTATION_FRACTION = 0.05
DEFAULT_MARGIN = 0.03
"""Fraction of the budget kept free by default (safety margin against run-to-run noise)."""

# Bound used where a layer has no segment of some kind: lower than any byte count.
_NO_BOUND = -(1 << 100)

PHASE_NO_GRADS: Phase = "no_grads"
PHASE_GRADS_RESIDENT: Phase = "grads_resident"
OPTIMIZER_STEP = "optimizer_step"


# --------------------------------------------------------------------------- reserve, budget
@dataclass(frozen=True, kw_only=True, slots=True)
class Reserve:
    """Device memory the model's tensors do not account for: CUDA context and allocator."""

    fixed_bytes: int
    """CUDA context plus the measured allocator overhead (bytes)."""
    fragmentation_fraction: float = 0.0
    """Extra allocator overhead as a fraction of the allocated peak (when not measured)."""
    source: str = ""
    """Where the numbers come from, for the plan's reasons."""

    def bytes_for(self, allocated_bytes: int) -> int:
        return self.fixed_bytes + math.ceil(self.fragmentation_fraction * max(allocated_bytes, 0))


NO_RESERVE = Reserve(fixed_bytes=0, source="none: not a CUDA device")


def plans_for_cuda(profile: Profile, device_spec: DeviceSpec | None = None) -> bool:
    """True when the plan is for a GPU: a GPU device spec is given, or, without a spec, the
    profile was measured on CUDA or timed on meta against a GPU spec."""
    if device_spec is not None:
        return device_spec.memory_bytes is not None  # the CPU entry has no capacity
    env = profile.environment
    if env.device == "cuda":
        return True
    return env.device == "meta" and env.device_profile not in (None, "", "cpu")


def reserve_for(profile: Profile, device_spec: DeviceSpec | None = None) -> Reserve:
    """The CUDA reserve: measured context and allocator bytes when the profile has them,
    else the documented defaults above; nothing off CUDA."""
    if not plans_for_cuda(profile, device_spec):
        return NO_RESERVE
    context = profile.context_bytes
    allocator = profile.allocator_reserve_bytes
    parts = []
    if context is None:
        context = DEFAULT_CONTEXT_BYTES
        parts.append("default CUDA context 512 MiB")
    else:
        parts.append("measured CUDA context")
    if allocator is None:
        parts.append(f"allocator {DEFAULT_FRAGMENTATION_FRACTION:.0%} of the peak (default)")
        return Reserve(
            fixed_bytes=int(context),
            fragmentation_fraction=DEFAULT_FRAGMENTATION_FRACTION,
            source=", ".join(parts),
        )
    parts.append("measured allocator overhead")
    return Reserve(fixed_bytes=int(context) + int(allocator), source=", ".join(parts))


def usable_budget_bytes(budget_bytes: int, margin: float = DEFAULT_MARGIN) -> int:
    """The budget less the safety margin: the most a predicted peak may be."""
    return math.floor(budget_bytes * (1.0 - margin))


def allocated_limit_bytes(budget_bytes: int, margin: float, reserve: Reserve) -> int:
    """The largest allocated (tensor) peak whose total, reserve included, fits the budget
    less the margin. The solver compares allocated peaks with this single number."""
    usable = usable_budget_bytes(budget_bytes, margin)
    if usable <= reserve.fixed_bytes:
        # No tensor fits; below zero the fragmentation term is 0, so this is exact (and
        # avoids walking down byte by byte).
        return usable - reserve.fixed_bytes
    limit = math.floor((usable - reserve.fixed_bytes) / (1.0 + reserve.fragmentation_fraction))
    while limit + reserve.bytes_for(limit) > usable:
        limit -= 1
    while (limit + 1) + reserve.bytes_for(limit + 1) <= usable:
        limit += 1
    return limit


def budget_for_peak_bytes(peak_bytes: int, margin: float) -> int:
    """The smallest budget whose usable part (less the margin) holds ``peak_bytes``."""
    budget = max(1, math.ceil(peak_bytes / (1.0 - margin)))
    while usable_budget_bytes(budget, margin) < peak_bytes:
        budget += 1
    return budget


# --------------------------------------------------------------------------- terms
def params_bytes(profile: Profile) -> int:
    """Parameters (trainable and frozen) and buffers: resident all step."""
    t = profile.totals
    return t.params_trainable_bytes + t.params_frozen_bytes + t.buffer_bytes


def grads_bytes(profile: Profile) -> int:
    """Gradients of the trainable parameters, when all of them exist."""
    return profile.totals.grad_bytes


def optimizer_state_bytes(profile: Profile) -> int:
    """Optimizer state (AdamW: two moments): resident all step after the first."""
    return profile.totals.optimizer_state_bytes


def point_bytes(point: Point, micro_batch: int) -> int:
    """Live bytes at a timeline point, rounded up."""
    return math.ceil(point[0] + point[1] * micro_batch)


def affine_bytes(value: Affine, micro_batch: int) -> int:
    """An affine byte count at ``micro_batch``, rounded up."""
    return math.ceil(value.at(micro_batch))


def savings_bytes(profile: Profile, micro_batch: int) -> tuple[int, ...]:
    """Per layer: bytes freed while it is held if it is checkpointed, rounded down."""
    return tuple(math.floor(layer.savings_bytes.at(micro_batch)) for layer in profile.layers)


# --------------------------------------------------------------------------- modes
# With per-layer modes (memplan.modes) the segment formula reads, for a mode per layer μ:
#
#     peak_segment(b, μ) = max(points_μ(active)(b)) − Σ_{j < held} savings_μ(j), j(b)
#
# keep: plain points, no saving; full: ckpt_points and savings_bytes (the all-checkpointed
# run); selective: selective_points and selective_savings_bytes (the all-selective run,
# normalised the same way); offload: plain points (its forward and backward hold at most
# what the plain run holds: tensors leave for the host after they are saved and come back
# one autograd node at a time) and the full checkpoint's savings (the layer's input may
# stay alive on the device as the previous layer's output; counting it as kept is safe).
# Each mode's points and savings are per layer, independent of the other layers' modes,
# so the solver's DP over prefix savings stays exact.
Checkpointed = Iterable[int | str] | Mapping[int | str, str]
"""Layers to checkpoint: indices or names (meaning ``full``), or a mapping to modes."""


def mode_of(checkpointed: Iterable[int] | Mapping[int, str], layer: int) -> str:
    """The mode of ``layer`` in a set (members are ``full``) or a mapping (absent: keep)."""
    if isinstance(checkpointed, Mapping):
        return checkpointed.get(layer, KEEP)
    return FULL if layer in checkpointed else KEEP  # type: ignore[operator]


def layer_modes(profile: Profile, checkpointed: Checkpointed) -> dict[int, str]:
    """Layer index -> mode for every layer not kept, from indices or names (``full``) or a
    mapping of indices or names to modes."""
    pairs = (
        list(checkpointed.items())
        if isinstance(checkpointed, Mapping)
        else [(item, FULL) for item in checkpointed]
    )
    indices = layer_indices(profile, [name for name, _ in pairs])
    del indices  # validates every name
    index = {name: i for i, name in enumerate(profile.layer_names)}
    out: dict[int, str] = {}
    for item, mode in pairs:
        if mode not in MODES:
            raise BadInputError(
                f"Layer {item!r} has mode {mode!r}.", hint=f"Modes are {', '.join(MODES)}."
            )
        i = index[item] if isinstance(item, str) else int(item)
        if mode != KEEP:
            out[i] = mode
    return dict(sorted(out.items()))


def has_selective(profile: Profile) -> bool:
    """Whether the probe measured the ``selective`` mode (every layer and active segment)."""
    if not profile.layers or any(layer.selective_savings_bytes is None for layer in profile.layers):
        return False
    return all(
        seg.selective_points
        for segments in profile.timeline.values()
        for seg in segments
        if seg.active != "none"
    )


def available_modes(profile: Profile) -> tuple[str, ...]:
    """The modes this profile measured (offload, which depends on the device planned for,
    aside): keep and full, and selective when the probe ran it."""
    return (KEEP, SELECTIVE, FULL) if has_selective(profile) else (KEEP, FULL)


def mode_savings_bytes(profile: Profile, micro_batch: int, mode: str) -> tuple[int, ...]:
    """Per layer: bytes freed while it is held in ``mode``, rounded down."""
    if mode == KEEP:
        return (0,) * len(profile.layers)
    if mode in (FULL, OFFLOAD):
        return savings_bytes(profile, micro_batch)
    if mode == SELECTIVE:
        if not has_selective(profile):
            raise BadInputError(
                "This profile has no measurement of the selective mode.",
                hint="Probe the model again with this memplan, or leave selective out of --modes.",
            )
        return tuple(
            math.floor(layer.selective_savings_bytes.at(micro_batch))  # type: ignore[union-attr]
            for layer in profile.layers
        )
    raise ValueError(f"unknown mode {mode!r}")


def offload_host_bytes(profile: Profile, micro_batch: int) -> tuple[int, ...]:
    """Per layer: bytes an offloaded layer copies to host memory (and back) per micro-step:
    everything its forward saves for backward, rounded up (more than the device frees, which
    is safe for both the host-memory cap and the copy time)."""
    return tuple(max(affine_bytes(layer.saved_bytes, micro_batch), 0) for layer in profile.layers)


def held_savings_bytes(savings: Sequence[int], checkpointed: frozenset[int], held: int) -> int:
    """Savings of the checkpointed layers among the ``held`` ones (layers 0 .. held-1)."""
    return sum(savings[j] for j in checkpointed if j < held)


def held_savings_prefix_bytes(savings: Sequence[int], checkpointed: frozenset[int]) -> list[int]:
    """``held_savings_bytes`` for every ``held`` from 0 to n at once."""
    prefix = [0]
    for j, saving in enumerate(savings):
        prefix.append(prefix[-1] + (saving if j in checkpointed else 0))
    return prefix


def held_mode_prefix_bytes(
    profile: Profile, micro_batch: int, checkpointed: Iterable[int] | Mapping[int, str]
) -> list[int]:
    """Held savings for every ``held`` from 0 to n, each layer in its own mode."""
    per_mode: dict[str, tuple[int, ...]] = {}
    prefix = [0]
    for j in range(len(profile.layers)):
        mode = mode_of(checkpointed, j)
        if mode not in per_mode:
            per_mode[mode] = mode_savings_bytes(profile, micro_batch, mode)
        prefix.append(prefix[-1] + per_mode[mode][j])
    return prefix


def segment_points_bytes(
    segment: Segment, micro_batch: int, active_checkpointed: bool | str
) -> int:
    """Highest no-checkpoint-reference point of a segment, for the active layer's mode
    (``True``: full, ``False``: keep): the all-checkpointed points when it is checkpointed,
    the all-selective ones when selective, else the plain ones."""
    mode = (
        active_checkpointed
        if isinstance(active_checkpointed, str)
        else (FULL if active_checkpointed else KEEP)
    )
    points = segment.points
    if segment.active != "none":
        if mode == FULL:
            points = segment.ckpt_points
        elif mode == SELECTIVE:
            if not segment.selective_points:
                raise ValueError("segment has no selective_points")
            points = segment.selective_points
    return max(point_bytes(p, micro_batch) for p in points)


def segment_peak_bytes(
    segment: Segment, micro_batch: int, checkpointed: frozenset[int], savings: Sequence[int]
) -> int:
    """``peak_segment(b, C)`` of profile.py's docstring."""
    top = segment_points_bytes(segment, micro_batch, segment.held in checkpointed)
    return top - held_savings_bytes(savings, checkpointed, segment.held)


def optimizer_step_peak_bytes(profile: Profile, micro_batch: int) -> int:
    """Live-byte peak of the optimizer step (params, grads, state and its transient)."""
    return affine_bytes(profile.optimizer_step_peak_bytes, micro_batch)


def phases_for(accumulation_steps: int) -> tuple[Phase, ...]:
    """Micro-step phases one optimizer step runs: with k = 1 gradients are never resident
    during a forward, so only the first-micro-step timeline applies."""
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    if accumulation_steps == 1:
        return (PHASE_NO_GRADS,)
    return (PHASE_NO_GRADS, PHASE_GRADS_RESIDENT)


def layer_indices(profile: Profile, layers: Iterable[int | str]) -> frozenset[int]:
    """Layer indices from indices or fully-qualified names."""
    index = {name: i for i, name in enumerate(profile.layer_names)}
    out = set()
    for item in layers:
        if isinstance(item, str) and item not in index:
            raise BadInputError(
                f"Layer {item!r} is not a checkpoint candidate of this profile.",
                hint="Its layers are: " + (", ".join(profile.layer_names) or "(none)") + ".",
            )
        i = index[item] if isinstance(item, str) else int(item)
        if not 0 <= i < len(profile.layers):
            raise IndexError(f"layer index {i} out of range")
        out.add(i)
    return frozenset(out)


# --------------------------------------------------------------------------- per-rank terms
@dataclass(frozen=True, kw_only=True, slots=True)
class Sharding:
    """How the model state is spread over the data-parallel ranks, and how the engine that
    does it is configured (as memplan's emitted code configures it)."""

    strategy: Strategy = "ddp"
    """``ddp`` (replicas), ``zero1`` (optimizer state sharded), ``zero2`` (and gradients),
    ``fsdp`` (and parameters: FSDP2 ``fully_shard`` / ZeRO-3)."""
    world_size: int = 1
    gradient_as_bucket_view: bool = True
    """DDP's gradients are views into its all-reduce buckets (memplan's emitted code sets it)."""
    fsdp_backward_prefetch: int = 1
    """FSDP2 all-gathers the next unit during the current unit's backward (its default)."""
    zero2_bucket_elements: int = 500_000_000
    """DeepSpeed ``reduce_bucket_size`` (elements); 5e8 is DeepSpeed's documented default and
    what memplan's DeepSpeed config writes."""
    grad_sync: GradSync = "last_micro_step"
    """FSDP with accumulation: reduce-scatter on the last micro-step only (unsharded gradients
    until then) or on every micro-step (sharded gradients); see ``memplan.plan.GradSync``."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(
                f"grad_sync must be one of {', '.join(GRAD_SYNCS)}, got {self.grad_sync!r}"
            )


SINGLE = Sharding()
"""One process, nothing sharded: the probe's own situation (adjustments are all zero)."""


def sharding_for(plan: Plan) -> Sharding:
    return Sharding(strategy=plan.strategy, world_size=plan.world_size, grad_sync=plan.grad_sync)


def element_bytes(profile: Profile) -> int:
    """Bytes per parameter element (the probe's parameter dtype)."""
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}.get(
        profile.environment.param_dtype, 4
    )


MASTER_ELEMENT_BYTES = 4
"""fp32: the dtype of master parameters, their gradients once reduced, and the optimizer
state under a mixed-precision policy (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=float32)``)."""


def mixed_precision_params(profile: Profile, sharding: Sharding) -> bool:
    """Whether the profile was probed with parameters in the compute dtype (``params``) and
    the plan shards them with FSDP's mixed-precision policy: the probe's parameter, gradient
    and optimizer-state bytes are then those of bf16 copies, and a rank keeps fp32 ones."""
    return profile.environment.mixed_precision == "params" and sharding.strategy == "fsdp"


def master_element_bytes(profile: Profile, sharding: Sharding) -> int:
    """Bytes per element of what a rank keeps at rest (params, reduced grads, state)."""
    if mixed_precision_params(profile, sharding):
        return MASTER_ELEMENT_BYTES
    return element_bytes(profile)


def master_bytes(profile: Profile, sharding: Sharding, probed_bytes: int) -> int:
    """``probed_bytes`` of parameter-shaped tensors (params, grads, Adam moments) at the
    dtype a rank keeps them in: ×2 from bf16 to fp32 masters under a mixed-precision policy,
    unchanged otherwise. (AdamW's per-tensor ``step`` counters are fp32 already and get
    doubled too: a few bytes per parameter tensor, on the safe side.)"""
    e = element_bytes(profile)
    return probed_bytes * master_element_bytes(profile, sharding) // e


def shard_bytes(total_bytes: int, world_size: int, element: int = 4) -> int:
    """One rank's share of ``total_bytes`` split over ``world_size`` ranks, padded as the
    engines pad: FSDP2 chunks every parameter on dim 0 (``torch.chunk``) and pads the last
    chunk to ceil(dim0 / world) rows (torch.distributed.fsdp.fully_shard docs); DeepSpeed
    ZeRO pads its flat partitions to a multiple of the world size. The profile keeps no
    parameter shapes, so this pads the *elements* of a group to a multiple of the world size:
    exact when every dim 0 divides by the world size (e.g. GPT widths on 2, 4, 8 ranks), and
    low by at most (world − 1) rows per parameter otherwise."""
    if world_size <= 1 or total_bytes <= 0:
        return max(total_bytes, 0)
    elements = math.ceil(total_bytes / element)
    return math.ceil(elements / world_size) * element


def unit_params_bytes(profile: Profile, index: int) -> int:
    """Parameters of candidate layer ``index``: one FSDP unit (memplan shards each
    checkpoint candidate as its own ``fully_shard`` unit, and the rest as the root)."""
    layer = profile.layers[index]
    return layer.params_trainable_bytes + layer.params_frozen_bytes


def root_params_bytes(profile: Profile) -> int:
    """Parameters outside the candidate layers (embeddings, head): the FSDP root unit."""
    t = profile.totals
    layers = sum(unit_params_bytes(profile, i) for i in range(len(profile.layers)))
    return max(t.params_trainable_bytes + t.params_frozen_bytes - layers, 0)


def rank_params_bytes(profile: Profile, sharding: Sharding) -> int:
    """Parameters and buffers one rank holds at rest. FSDP / ZeRO-3 keeps 1/world of every
    unit's parameters (ZeRO paper, Rajbhandari et al. 2020, §5.3 "P_os+g+p"); buffers are
    not sharded (FSDP2 only converts parameters to DTensor). The others keep them all."""
    if sharding.strategy != "fsdp" or (
        sharding.world_size == 1 and not mixed_precision_params(profile, sharding)
    ):
        return params_bytes(profile)
    w, e = sharding.world_size, master_element_bytes(profile, sharding)
    units = [unit_params_bytes(profile, i) for i in range(len(profile.layers))]
    units.append(root_params_bytes(profile))
    return (
        sum(shard_bytes(master_bytes(profile, sharding, u), w, e) for u in units)
        + profile.totals.buffer_bytes
    )


def rank_optimizer_state_bytes(profile: Profile, sharding: Sharding) -> int:
    """Optimizer state one rank holds: all of it with DDP; 1/world from ZeRO-1 on (ZeRO
    paper §5.1 "P_os"; torch.distributed.optim.ZeroRedundancyOptimizer docs: each rank keeps
    the state of its parameter partition). ZeroRedundancyOptimizer partitions whole tensors
    greedily, so a rank's share can differ from 1/world by part of one tensor."""
    state = master_bytes(profile, sharding, optimizer_state_bytes(profile))
    if sharding.strategy == "ddp" or sharding.world_size == 1:
        return state
    return shard_bytes(state, sharding.world_size, master_element_bytes(profile, sharding))


def optimizer_transient_bytes(profile: Profile) -> int:
    """What the optimizer step needs above params, grads and state (foreach temporaries),
    from the measured step peak at micro-batch 0 (the batch excluded)."""
    base = params_bytes(profile) + grads_bytes(profile) + optimizer_state_bytes(profile)
    return max(math.ceil(profile.optimizer_step_peak_bytes.intercept) - base, 0)


def ddp_bucket_bytes(profile: Profile, sharding: Sharding) -> int:
    """DDP's all-reduce buckets: the Reducer allocates flat buckets for every gradient when
    it is built (torch/csrc/distributed/c10d/reducer.cpp, ``initialize_buckets``) and keeps
    them for the life of the model, so they are resident in every micro-step, gradients set
    to None or not. With ``gradient_as_bucket_view=True`` (DDP docs; PyTorch PR #41954) the
    gradients *are* views of the buckets once synchronised, so the optimizer step holds no
    second copy; without it, the buckets are a second gradient-sized buffer throughout.
    Measured on CPU/gloo, 2 ranks, GPT example: +1.00 × gradient bytes in every micro-step."""
    if sharding.world_size == 1 or sharding.strategy not in ("ddp", "zero1"):
        return 0
    return grads_bytes(profile)


def bucket_views_replace_grads(sharding: Sharding, phase: str, accumulation_steps: int) -> bool:
    """The DDP bucket-view rule, in one place: with ``gradient_as_bucket_view=True`` and a
    synchronised first micro-step (no accumulation), each new gradient is copied into its
    bucket and freed, so the gradients the probe saw grow are the buckets (counted once);
    otherwise the buckets are resident on top of whatever gradients are held."""
    return (
        sharding.gradient_as_bucket_view
        and accumulation_steps == 1
        and phase == PHASE_NO_GRADS
        and sharding.world_size > 1
        and sharding.strategy in ("ddp", "zero1")
    )


def zero2_bucket_bytes(profile: Profile, sharding: Sharding) -> int:
    """DeepSpeed ZeRO-2's gradient reduction bucket (``reduce_bucket_size`` elements,
    DeepSpeed config docs; contiguous_gradients keeps one such buffer), no larger than the
    gradients themselves. An assumption: not measured here (no DeepSpeed in this setup)."""
    if sharding.strategy != "zero2" or sharding.world_size == 1:
        return 0
    return min(grads_bytes(profile), sharding.zero2_bucket_elements * element_bytes(profile))


def syncs_every_micro_step(sharding: Sharding, accumulation_steps: int) -> bool:
    """Whether gradients are reduced (and, sharded, scattered) in every micro-step. DDP and
    ZeRO-1 skip all-reduce with ``no_sync`` on all but the last micro-step; FSDP2 skips
    reduce-scatter with ``set_requires_gradient_sync(False)`` when ``grad_sync`` is
    ``last_micro_step`` and reduce-scatters every micro-step otherwise; DeepSpeed ZeRO-2
    reduces every micro-step (its gradients are partitioned, so it cannot defer)."""
    return (
        accumulation_steps == 1
        or sharding.strategy == "zero2"
        or (sharding.strategy == "fsdp" and sharding.grad_sync == "every_micro_step")
    )


def sharded_grads_removed_bytes(
    profile: Profile, sharding: Sharding, held_grads: int, accumulation_steps: int
) -> int:
    """Gradient bytes a rank does not hold, of ``held_grads`` the single process holds.
    ZeRO-2 keeps 1/world of every reduced gradient (ZeRO paper §5.2 "P_os+g"); FSDP too, but
    only when it reduce-scatters every micro-step: under ``set_requires_gradient_sync(False)``
    FSDP2 accumulates *unsharded* gradients (FSDP2 docs: "the equivalence of no_sync"), so
    with accumulation the gradients stay whole until the last micro-step (conservatively:
    counted whole in every micro-step). Under FSDP's mixed-precision policy the probe held
    bf16 gradients, and a rank holds fp32 ones (``reduce_dtype``): sharded, or, unsharded
    under ``set_requires_gradient_sync(False)``, upcast to fp32 after each unit's backward
    (FSDP2 ``FSDPParam.to_accumulated_grad_if_needed``), so the result can be negative."""
    if held_grads <= 0 or (
        sharding.world_size == 1 and not mixed_precision_params(profile, sharding)
    ):
        return 0
    kept = master_bytes(profile, sharding, held_grads)
    if sharding.strategy == "zero2" or (
        sharding.strategy == "fsdp" and syncs_every_micro_step(sharding, accumulation_steps)
    ):
        e = master_element_bytes(profile, sharding)
        return held_grads - shard_bytes(kept, sharding.world_size, e)
    return held_grads - kept


def fsdp_gathered_bytes(profile: Profile, sharding: Sharding, phase: str, index: int) -> int:
    """Unsharded parameters alive at a segment under FSDP2 (its docs: pre-forward/backward
    hooks all-gather a unit, post-forward/backward hooks free it):

    * the root unit (everything outside the candidate layers) is not resharded after forward
      (FSDP2 keeps the root whole, as backward needs it at once): whole all micro-step;
    * a candidate layer is whole during its forward and its backward;
    * in backward, FSDP2's default prefetch all-gathers the unit whose backward comes next
      (``fsdp_backward_prefetch`` units) when the current one's backward begins, the root's
      included: from the loss on, the last layer is already whole (measured on CPU/gloo).

    Forward prefetch is implicit on CUDA streams only; on CPU it does not happen, and on CUDA
    the allocator reserve covers it. The brief all-gather staging buffer (a flat copy of a
    unit while it is split into parameters) is not modelled."""
    if sharding.strategy != "fsdp":
        return 0
    segments = profile.timeline[phase]
    segment = segments[index]
    h, n = segment.held, len(profile.layers)
    gathered = root_params_bytes(profile)
    if segment.active != "none":
        gathered += unit_params_bytes(profile, h)
    in_backward = segment.active == "bwd" or (
        segment.active == "none" and (h == n or _backward_started(segments, index))
    )
    if in_backward:
        for j in range(max(h - sharding.fsdp_backward_prefetch, 0), h):
            gathered += unit_params_bytes(profile, j)
    return gathered


def fsdp_reduce_scatter_bytes(
    profile: Profile, sharding: Sharding, phase: str, segment: Segment, accumulation_steps: int
) -> int:
    """The reduce-scatter input FSDP2 builds from a unit's gradients at the end of its
    backward (a padded flat copy, alive next to the unsharded gradients until the collective
    ends). Only in micro-steps that synchronise: every one when not accumulating, else the
    last one (the ``grads_resident`` phase; counted in all of them, conservatively). Under
    the mixed-precision policy the input is in ``reduce_dtype`` (fp32)."""
    if sharding.strategy != "fsdp" or sharding.world_size == 1 or segment.active != "bwd":
        return 0
    synced = syncs_every_micro_step(sharding, accumulation_steps) or phase == PHASE_GRADS_RESIDENT
    if not synced:
        return 0
    grads = master_bytes(profile, sharding, profile.layers[segment.held].grad_bytes)
    e = master_element_bytes(profile, sharding)
    return shard_bytes(grads, sharding.world_size, e) * sharding.world_size


def segment_adjust_bytes(
    profile: Profile,
    sharding: Sharding,
    phase: str,
    index: int,
    accumulation_steps: int,
) -> int:
    """Per-rank live bytes at a segment minus what the single-process probe measured there:

    * − parameters a rank does not hold (FSDP), − optimizer state it does not hold (ZeRO-1+),
      − gradients it does not hold (ZeRO-2; FSDP without accumulation);
    * + DDP's buckets less the gradients already counted (see ``ddp_bucket_bytes``: with
      bucket views a synchronised micro-step copies each new gradient into its bucket and
      frees it, so with k = 1 the probe's growing gradients are replaced by the bucket);
    * + ZeRO-2's reduction bucket; + FSDP's gathered units and reduce-scatter input.

    Zero for one process (any strategy but FSDP, whose all-gathers still copy)."""
    if sharding == SINGLE:
        return 0
    segment = profile.timeline[phase][index]
    held_grads = grads_at_bytes(profile, phase, index)
    delta = 0
    delta -= params_bytes(profile) - rank_params_bytes(profile, sharding)
    delta -= optimizer_state_bytes(profile) - rank_optimizer_state_bytes(profile, sharding)
    delta -= sharded_grads_removed_bytes(profile, sharding, held_grads, accumulation_steps)
    bucket = ddp_bucket_bytes(profile, sharding)
    if bucket:
        replaced = bucket_views_replace_grads(sharding, phase, accumulation_steps)
        delta += bucket - (held_grads if replaced else 0)
    delta += zero2_bucket_bytes(profile, sharding)
    delta += fsdp_gathered_bytes(profile, sharding, phase, index)
    delta += fsdp_reduce_scatter_bytes(profile, sharding, phase, segment, accumulation_steps)
    return delta


def optimizer_adjust_bytes(profile: Profile, sharding: Sharding) -> int:
    """Per-rank optimizer-step peak minus the probe's: the step runs on what a rank holds, and
    its temporaries scale with the parameters it updates (ZeRO-1 and up: 1/world). DDP's
    buckets are the gradients (bucket views); without bucket views they are a second copy."""
    if sharding == SINGLE:
        return 0
    w, e = sharding.world_size, master_element_bytes(profile, sharding)
    delta = -(params_bytes(profile) - rank_params_bytes(profile, sharding))
    delta -= optimizer_state_bytes(profile) - rank_optimizer_state_bytes(profile, sharding)
    if sharding.strategy in ("zero2", "fsdp"):
        grads = grads_bytes(profile)
        delta -= grads - shard_bytes(master_bytes(profile, sharding, grads), w, e)
    if sharding.strategy != "ddp":
        transient = optimizer_transient_bytes(profile)
        delta -= transient - shard_bytes(master_bytes(profile, sharding, transient), w, e)
    if ddp_bucket_bytes(profile, sharding) and not sharding.gradient_as_bucket_view:
        delta += ddp_bucket_bytes(profile, sharding)
    return delta


def rank_state_bytes(profile: Profile, sharding: Sharding) -> tuple[int, int, int]:
    """(params, grads, optimizer state) one rank holds in the optimizer step."""
    w, e = sharding.world_size, master_element_bytes(profile, sharding)
    grads = grads_bytes(profile)
    if sharding.strategy in ("zero2", "fsdp"):
        grads = shard_bytes(master_bytes(profile, sharding, grads), w, e)
    return (
        rank_params_bytes(profile, sharding),
        grads,
        rank_optimizer_state_bytes(profile, sharding),
    )


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


def _backward_started(segments: Sequence[Segment], index: int) -> bool:
    return any(seg.active == "bwd" for seg in segments[: index + 1])


def grads_at_bytes(profile: Profile, phase: str, index: int | None) -> int:
    """Gradient bytes alive at a segment. Resident phases and the optimizer step hold all of
    them; the first micro-step holds those of the layers whose backward has finished (fixed
    parts' gradients counted once backward has reached a layer: an estimate, since fixed
    parts carry no position)."""
    if phase != PHASE_NO_GRADS or index is None:
        return grads_bytes(profile)
    segments = profile.timeline[phase]
    segment = segments[index]
    if not _backward_started(segments, index):
        return 0
    first_done = segment.held + 1 if segment.active == "bwd" else segment.held
    layer_grads = sum(layer.grad_bytes for layer in profile.layers[first_done:])
    fixed_grads = max(grads_bytes(profile) - sum(layer.grad_bytes for layer in profile.layers), 0)
    return layer_grads + (fixed_grads if segment.held < len(profile.layers) else 0)


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


# --------------------------------------------------------------------------- bounds
_INFEASIBLE = 1 << 100
"""A need no prefix saving meets: a layer with no allowed mode."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBounds:
    """The step peak at one micro-batch reduced to per-layer bounds, for the solver.

    With ``P_h`` the savings of the layers 0 .. h-1 in their modes, the allocated step peak
    of a mode assignment is the largest of ``optimizer_bytes``, ``none_bytes[h] − P_h``
    (h = 0 .. n) and, for each layer h, ``active_bytes(mode of h, h) − P_h``. This is the
    segment formula with the maxima taken per ``held`` first; it is equal to
    :func:`step_peak` to the byte. ``plain_bytes``/``ckpt_bytes``/``savings`` are the keep and
    full entries; ``mode_bytes``/``mode_savings`` hold the other modes of ``modes``."""

    micro_batch: int
    accumulation_steps: int
    savings: tuple[int, ...]
    """Per layer: what full checkpointing frees while it is held."""
    none_bytes: tuple[int, ...]
    """Length n + 1: highest point of the segments with no active layer, by ``held``."""
    plain_bytes: tuple[int, ...]
    """Length n: highest point while layer h runs, not checkpointed."""
    ckpt_bytes: tuple[int, ...]
    """Length n: highest normalised point while layer h runs, checkpointed."""
    optimizer_bytes: int
    modes: tuple[str, ...] = (KEEP, FULL)
    """Modes a layer may take (``keep`` first)."""
    mode_bytes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per mode other than keep and full: highest normalised point while layer h runs."""
    mode_savings: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per mode other than keep and full: what the mode frees while layer h is held."""
    host_bytes: tuple[int, ...] = ()
    """Per layer: host memory an offloaded layer takes (empty without offload)."""
    host_limit_bytes: int | None = None
    """Host memory offloaded layers may take together; None: no limit."""

    def saving(self, mode: str, h: int) -> int:
        if mode == KEEP:
            return 0
        if mode == FULL:
            return self.savings[h]
        return self.mode_savings[mode][h]

    def active(self, mode: str, h: int) -> int:
        if mode == KEEP:
            return self.plain_bytes[h]
        if mode == FULL:
            return self.ckpt_bytes[h]
        return self.mode_bytes[mode][h]

    def host(self, mode: str, h: int) -> int:
        return self.host_bytes[h] if mode == OFFLOAD else 0

    def allowed(
        self,
        h: int,
        forced_in: frozenset[int] = frozenset(),
        forced_out: frozenset[int] = frozenset(),
    ) -> tuple[str, ...]:
        """Modes layer h may take: keep only if it is never checkpointed, any mode but keep
        if it is always checkpointed."""
        if h in forced_out:
            return (KEEP,)
        if h in forced_in:
            return tuple(m for m in self.modes if m != KEEP)
        return self.modes

    @property
    def host_binding(self) -> bool:
        """Whether the host-memory limit can bind (offload allowed and every layer
        offloaded would exceed it)."""
        return (
            OFFLOAD in self.modes
            and self.host_limit_bytes is not None
            and sum(self.host_bytes) > self.host_limit_bytes
        )


def step_bounds(
    profile: Profile,
    micro_batch: int,
    accumulation_steps: int,
    sharding: Sharding = SINGLE,
    modes: Sequence[str] = (KEEP, FULL),
    host_limit_bytes: int | None = None,
) -> StepBounds:
    n = len(profile.layers)
    modes = tuple(m for m in MODES if m in set(modes) | {KEEP})
    extra = [m for m in modes if m not in (KEEP, FULL)]
    none = [_NO_BOUND] * (n + 1)
    plain = [_NO_BOUND] * n
    ckpt = [_NO_BOUND] * n
    others = {m: [_NO_BOUND] * n for m in extra}
    for phase in phases_for(accumulation_steps):
        for index, segment in enumerate(profile.timeline[phase]):
            h = segment.held
            adjust = (
                0
                if sharding == SINGLE
                else segment_adjust_bytes(profile, sharding, phase, index, accumulation_steps)
            )
            top = segment_points_bytes(segment, micro_batch, active_checkpointed=False) + adjust
            if segment.active == "none":
                none[h] = max(none[h], top)
            else:
                plain[h] = max(plain[h], top)
                ckpt[h] = max(ckpt[h], segment_points_bytes(segment, micro_batch, True) + adjust)
                for m in extra:
                    others[m][h] = max(
                        others[m][h], segment_points_bytes(segment, micro_batch, m) + adjust
                    )
    return StepBounds(
        micro_batch=micro_batch,
        accumulation_steps=accumulation_steps,
        savings=savings_bytes(profile, micro_batch),
        none_bytes=tuple(none),
        plain_bytes=tuple(plain),
        ckpt_bytes=tuple(ckpt),
        optimizer_bytes=optimizer_step_peak_bytes(profile, micro_batch)
        + optimizer_adjust_bytes(profile, sharding),
        modes=modes,
        mode_bytes={m: tuple(v) for m, v in others.items()},
        mode_savings={m: mode_savings_bytes(profile, micro_batch, m) for m in extra},
        host_bytes=offload_host_bytes(profile, micro_batch) if OFFLOAD in modes else (),
        host_limit_bytes=host_limit_bytes,
    )


def bounds_peak_bytes(bounds: StepBounds, checkpointed: Iterable[int] | Mapping[int, str]) -> int:
    """Allocated step peak of a checkpoint set (full) or a mode assignment, from the bounds
    (equals step_peak's)."""
    chosen: Iterable[int] | Mapping[int, str] = (
        checkpointed if isinstance(checkpointed, Mapping) else frozenset(checkpointed)
    )
    best = bounds.optimizer_bytes
    prefix = 0
    for h in range(len(bounds.plain_bytes)):
        mode = mode_of(chosen, h)
        best = max(best, bounds.none_bytes[h] - prefix, bounds.active(mode, h) - prefix)
        prefix += bounds.saving(mode, h)
    return max(best, bounds.none_bytes[-1] - prefix)


def host_total_bytes(bounds: StepBounds, checkpointed: Iterable[int] | Mapping[int, str]) -> int:
    """Host memory the offloaded layers of an assignment take."""
    if not isinstance(checkpointed, Mapping):
        return 0
    return sum(bounds.host(mode, h) for h, mode in checkpointed.items())


def prefix_saving_bounds(
    bounds: StepBounds,
    limit_bytes: int,
    pick: Callable[[list[int]], int],
    *,
    forced_in: frozenset[int] = frozenset(),
    forced_out: frozenset[int] = frozenset(),
) -> list[int]:
    """Backward induction over layers h = n-1 .. 0 on the prefix saving ``P_h``: for each
    allowed mode of layer h, the least ``P_h`` that keeps layer h's segments and, through
    ``P_{h+1}``, everything after it within ``limit_bytes``; ``pick`` combines the modes
    (``min``: some completion fits; ``max``: every one does). The host-memory limit is left
    out (a relaxation: the solver checks it)."""
    n = len(bounds.plain_bytes)
    need = [0] * (n + 1)
    need[n] = bounds.none_bytes[n] - limit_bytes
    for h in range(n - 1, -1, -1):
        none_need = bounds.none_bytes[h] - limit_bytes
        options = [
            max(
                none_need,
                bounds.active(mode, h) - limit_bytes,
                need[h + 1] - bounds.saving(mode, h),
            )
            for mode in bounds.allowed(h, forced_in, forced_out)
        ]
        need[h] = pick(options) if options else _INFEASIBLE
    return need


def feasible_floor_bytes(
    bounds: StepBounds,
    limit_bytes: int,
    *,
    forced_in: frozenset[int] = frozenset(),
    forced_out: frozenset[int] = frozenset(),
) -> list[int]:
    """``R[h]``: the least prefix saving ``P_h`` from which some choice of modes for layers
    h .. n-1 keeps every later point within ``limit_bytes`` (exact, by backward induction:
    a higher ``P_h`` never hurts, so the feasible values of ``P_h`` are an interval
    [R[h], ∞)). A plan exists iff ``R[0] <= 0`` and the optimizer step fits (and, with
    offload, the host limit holds)."""
    return prefix_saving_bounds(
        bounds, limit_bytes, min, forced_in=forced_in, forced_out=forced_out
    )


def fits_somehow(
    bounds: StepBounds,
    limit_bytes: int,
    *,
    forced_in: frozenset[int] = frozenset(),
    forced_out: frozenset[int] = frozenset(),
) -> bool:
    """Whether any mode assignment (respecting the forced layers) keeps the allocated peak
    within ``limit_bytes`` (the host limit aside)."""
    if bounds.optimizer_bytes > limit_bytes:
        return False
    floor = feasible_floor_bytes(bounds, limit_bytes, forced_in=forced_in, forced_out=forced_out)
    return floor[0] <= 0


def min_allocated_bytes(
    bounds: StepBounds,
    *,
    forced_in: frozenset[int] = frozenset(),
    forced_out: frozenset[int] = frozenset(),
) -> int:
    """The smallest allocated peak any mode assignment reaches at this micro-batch (the host
    limit aside): the minimum over assignments, exact (binary search on the limit;
    feasibility is monotone in it). Checkpointing everything is not always the minimum: a
    recompute can peak higher than the plain backward it replaces."""
    n = len(bounds.plain_bytes)
    some = {h: bounds.allowed(h, forced_in, forced_out)[0] for h in forced_in}
    hi = bounds_peak_bytes(bounds, some)  # any valid assignment is an upper bound
    # A lower bound: no assignment saves more than every layer's largest positive saving.
    most_saved = sum(max(max(bounds.saving(m, h), 0) for m in bounds.modes) for h in range(n))
    active = [min(bounds.active(m, h) for m in bounds.modes) for h in range(n)]
    least = max(bounds.optimizer_bytes, max([*bounds.none_bytes, *active]) - most_saved)
    lo = least - 1  # infeasible
    lo = min(lo, hi - 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits_somehow(bounds, mid, forced_in=forced_in, forced_out=forced_out):
            hi = mid
        else:
            lo = mid
    return hi


def plan_peak(profile: Profile, plan: Plan, device_spec: DeviceSpec | None = None) -> Peak:
    """The predicted peak of a written plan against a profile (for ``verify`` and ``check``):
    its micro-batch, accumulation and checkpoint layers, with the reserve for ``device_spec``
    (or the profile's device), per rank for its strategy and world size. ``allocated_bytes``
    is what max_memory_allocated should show."""
    return step_peak(
        profile,
        plan.micro_batch_size,
        plan.checkpoint,
        plan.accumulation_steps,
        reserve=reserve_for(profile, device_spec),
        sharding=sharding_for(plan),
    )
