"""Per-rank terms under data parallelism (Sharding): what DDP, ZeRO-1/2 and FSDP remove from or add
to one process's measured bytes, per phase and segment. No torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from memplan.memory.edge_units import EdgeBytes, edge_gathered, edge_split
from memplan.memory.fsdp_moments import (
    UnitGrads,
    post_backward_moments,
    reduce_after_schedule_moments,
    reduce_output_bytes,
    tail_reduced_in_forward,
)
from memplan.memory.memo import by_identity
from memplan.memory.terms import (
    PHASE_GRADS_RESIDENT,
    PHASE_NO_GRADS,
    backward_started,
    fixed_grads_bytes,
    grads_bytes,
    optimizer_state_bytes,
    params_bytes,
)
from memplan.memory.zero_partition import rank_shares
from memplan.plan import GRAD_SYNCS, STRATEGIES, GradSync, Plan, Strategy
from memplan.profile import FixedPart, Layer, Profile


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
    reshard_after_forward: bool = True
    """FSDP2 frees a unit's gathered parameters after its forward (its default). False under
    pipeline stages, as torchtitan runs them (torchtitan/distributed/fsdp.py
    ``get_fsdp_reshard_after_forward_policy``: "default" is ``not pp_enabled``, to avoid an
    all-gather per micro-batch) and memplan's runtime does: every unit stays whole all step."""
    """FSDP with accumulation: reduce-scatter on the last micro-step only (unsharded gradients
    until then) or on every micro-step (sharded gradients); see ``memplan.plan.GradSync``."""
    edge_units: bool = False
    """FSDP without pipeline stages: the parts outside the blocks are torchtitan's two units
    (``Parallel.fsdp_units`` ``torchtitan-2507``: the embeddings resharded after their
    forward, the norm + head reduce-scattered after their backward; memplan.memory.
    edge_units) instead of one root unit whole all step."""
    reduce_after_schedule: bool = False
    """FSDP under pipeline stages: no unit reduce-scatters during any micro-batch's backward;
    every unit keeps its gradients unsharded until the schedule ends, then all reduce
    (torch 2.13 ``torch/distributed/pipelining/stage.py``: ``backward_maybe_with_nosync``
    calls ``set_requires_gradient_sync(False)`` on the stage's FSDP module for every
    micro-batch, and ``perform_reduce_grad`` runs each unit's ``post_backward`` after the last;
    torchtitan's stages and memplan's runtime both run it so). That end-of-schedule
    reduction, with no activations left, is one more moment of the last segment
    (``reduce_after_schedule_moments``)."""

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


def float8_gather_saving_bytes(profile: Profile, float8_param_bytes: int) -> int:
    """Bytes FSDP2's float8 all-gather does not gather of ``float8_param_bytes`` (converted
    weights as probed): torchao's ``enable_fsdp_float8_all_gather`` casts each shard to
    float8 before the all-gather (torchao/float8/fsdp_utils.py at 36027d8,
    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``), so the unsharded weight is
    one byte an element, not the compute dtype's two. 0 without float8 all-gather."""
    float8 = profile.environment.float8
    if float8 is None or not float8.fsdp_float8_all_gather:
        return 0
    return float8_param_bytes - float8_param_bytes // element_bytes(profile)


def rank_float8_bytes(item: Layer | FixedPart, tp: int) -> int:
    """A TP rank's share of a part's float8 weights: the converted linears are the ones a
    Llama TP plan splits (column- and row-wise), so as much of them as the plan shards is
    divided by the degree."""
    sharded = min(item.float8_param_bytes, item.tp_sharded_bytes)
    return math.ceil(item.float8_param_bytes - sharded * (1.0 - 1.0 / tp))


def gathered_unit_bytes(profile: Profile, index: int) -> int:
    """What FSDP2's all-gather makes of candidate layer ``index``: its parameters, the
    float8 weights at one byte an element (``float8_gather_saving_bytes``)."""
    layer = profile.layers[index]
    return unit_params_bytes(profile, index) - float8_gather_saving_bytes(
        profile, layer.float8_param_bytes
    )


def gathered_root_bytes(profile: Profile) -> int:
    """What FSDP2's all-gather makes of the root unit (see ``gathered_unit_bytes``)."""
    root_float8 = sum(part.float8_param_bytes for part in profile.fixed)
    return root_params_bytes(profile) - float8_gather_saving_bytes(profile, root_float8)


def gathered_edge_bytes(profile: Profile) -> tuple[int, int] | None:
    """What FSDP2's all-gathers make of torchtitan's two edge units (``Sharding.edge_units``),
    the lead's and the tail's: the root unit's bytes divided between them; None where they
    are one unit (``edge_split``)."""
    split = edge_split(profile, root_params_bytes(profile), fixed_grads_bytes(profile))
    if split is None:
        return None
    return _edge_gathered(profile, split[0]), _edge_gathered(profile, split[1])


def _edge_gathered(profile: Profile, unit: EdgeBytes) -> int:
    """One edge unit's parameters as FSDP2's all-gather makes them (float8 at one byte)."""
    return unit.params - float8_gather_saving_bytes(profile, unit.float8)


@by_identity(64)
def gathered_params_bytes(profile: Profile) -> int:
    """The whole model as FSDP2's all-gathers move it (what ``communication_bytes`` is
    charged for the all-gathers)."""
    units = sum(gathered_unit_bytes(profile, i) for i in range(len(profile.layers)))
    return units + gathered_root_bytes(profile)


@by_identity(64)
def root_params_bytes(profile: Profile) -> int:
    """Parameters outside the candidate layers (embeddings, head): the FSDP root unit."""
    t = profile.totals
    layers = sum(unit_params_bytes(profile, i) for i in range(len(profile.layers)))
    return max(t.params_trainable_bytes + t.params_frozen_bytes - layers, 0)


@by_identity(256)
def rank_params_bytes(profile: Profile, sharding: Sharding) -> int:
    """Parameters and buffers one rank holds at rest. FSDP / ZeRO-3 keeps 1/world of every
    unit's parameters (ZeRO paper, Rajbhandari et al. 2020, §5.3 "P_os+g+p"); buffers and
    cached tensors are not sharded (FSDP2 only converts parameters to DTensor). The others keep them all."""
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
        + profile.totals.cached_bytes
    )


def rank_optimizer_state_bytes(profile: Profile, sharding: Sharding) -> int:
    """Optimizer state one rank holds (the fullest rank's): all of it with DDP; 1/world of
    it under ZeRO-2 and FSDP (ZeRO paper §5.1 "P_os"; both split every tensor or a flat
    buffer evenly). ``zero1``'s ZeroRedundancyOptimizer gives each rank whole tensors
    (memplan.memory.zero_partition): its fullest rank's share, by torch's rule over the
    profile's parts."""
    state = master_bytes(profile, sharding, optimizer_state_bytes(profile))
    if sharding.strategy == "ddp" or sharding.world_size == 1:
        return state
    even = shard_bytes(state, sharding.world_size, master_element_bytes(profile, sharding))
    if sharding.strategy == "zero1":
        return max(zero1_rank_state_bytes(profile, sharding))
    return even


def zero1_rank_state_bytes(profile: Profile, sharding: Sharding) -> list[int]:
    """Each ZeRO-1 rank's optimizer state, in rank order (``zero_partition.rank_shares``),
    the fullest never below the even share nor any above the whole state."""
    state = master_bytes(profile, sharding, optimizer_state_bytes(profile))
    w = sharding.world_size
    parts = [p.optimizer_state_bytes for p in (*profile.layers, *profile.fixed)]
    shares = rank_shares(parts, optimizer_state_bytes(profile) - sum(parts), w)
    even = shard_bytes(state, w, master_element_bytes(profile, sharding))
    ranks = [min(state, master_bytes(profile, sharding, share)) for share in shares]
    fullest = ranks.index(max(ranks))
    ranks[fullest] = max(ranks[fullest], even)
    return ranks


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
    """Gradient bytes a ZeRO-2 rank does not hold, of ``held_grads`` the single process
    holds: it keeps 1/world of every reduced gradient (ZeRO paper §5.2 "P_os+g"). FSDP's
    gradients depend on the place in the backward: ``fsdp_grads_bytes``."""
    del accumulation_steps  # ZeRO-2 reduces every micro-step
    if held_grads <= 0 or sharding.strategy != "zero2" or sharding.world_size == 1:
        return 0
    return held_grads - shard_bytes(held_grads, sharding.world_size, element_bytes(profile))


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
    the allocator reserve covers it. The flat all-gather outputs FSDP2 keeps in the forward
    (``_fsdp_param_group.py`` ``wait_for_unshard`` defers each free to the next unit's
    copy-out) are not modelled: where the forward is the peak (blocks whose linears are
    frozen) that is -11% on 2 gloo ranks; adding them as measured there over-predicted
    torchtitan's units by 12.6% and broke four measured checks, so it stays a known gap."""
    if sharding.strategy != "fsdp":
        return 0
    if not sharding.reshard_after_forward:  # gathered at the first forward, kept all step
        return gathered_params_bytes(profile)
    segments = profile.timeline[phase]
    segment = segments[index]
    h, n = segment.held, len(profile.layers)
    edge = gathered_edge_bytes(profile) if sharding.edge_units else None
    if edge is not None:
        lead, tail = edge_gathered(
            segments, index, n, backward_started(segments, index), sharding.fsdp_backward_prefetch
        )
        gathered = (edge[0] if lead else 0) + (edge[1] if tail else 0)
    else:
        gathered = gathered_root_bytes(profile)
    if segment.active != "none":
        gathered += gathered_unit_bytes(profile, h)
    in_backward = segment.active == "bwd" or (
        segment.active == "none" and (h == n or backward_started(segments, index))
    )
    if in_backward:
        for j in range(max(h - sharding.fsdp_backward_prefetch, 0), h):
            gathered += gathered_unit_bytes(profile, j)
    return gathered


def _unit_grads(profile: Profile, sharding: Sharding, probed: int) -> UnitGrads:
    whole = master_bytes(profile, sharding, probed)
    shard = shard_bytes(whole, sharding.world_size, master_element_bytes(profile, sharding))
    return UnitGrads(
        probed=probed, whole=whole, scatter_input=shard * sharding.world_size, shard=shard
    )


def fsdp_sharded_grads_bytes(profile: Profile, sharding: Sharding) -> int:
    """Every unit's sharded gradient (the root's too) in ``reduce_dtype``, padded as FSDP2
    pads: what one rank's reduce-scatter outputs add up to after a backward."""
    units = [_unit_grads(profile, sharding, layer.grad_bytes) for layer in profile.layers]
    units.append(_unit_grads(profile, sharding, fixed_grads_bytes(profile)))
    return sum(unit.shard for unit in units)


def fsdp_shards_resident(sharding: Sharding, accumulation_steps: int) -> bool:
    """Whether the sharded gradients stay live from one micro-step into the next (FSDP
    reduce-scattering every micro-step with accumulation): then the allocated peak holds
    them already."""
    return (
        sharding.strategy == "fsdp"
        and accumulation_steps > 1
        and syncs_every_micro_step(sharding, accumulation_steps)
        and not sharding.reduce_after_schedule
    )


@dataclass(frozen=True, slots=True)
class _GradsTable:
    """What ``fsdp_grads_bytes`` reads at every segment of one (profile, sharding, phase,
    micro-steps): the units' gradients, the flags that say what a unit holds, and the
    layers' holdings summed ahead (``unposted[i]``: layers before ``i`` before their
    post_backward; ``posted[i]``: layers from ``i`` on after it), so that a segment costs a
    lookup, not a sum over every layer (the layout search asks every segment of every
    micro-batch of every layout)."""

    resident: bool  # earlier micro-steps' gradients exist
    syncing: bool  # a unit reduce-scatters in its post_backward
    sharded_before: bool  # accumulated sharded, in place
    units: tuple[UnitGrads, ...]
    root: UnitGrads
    tail: UnitGrads | None  # torchtitan's norm + head unit, reduced first
    root_params: int
    unposted: tuple[int, ...]
    posted: tuple[int, ...]

    def held(self, unit: UnitGrads, posted: bool) -> int:
        """The unit's gradients before (``posted`` False) or after its post_backward."""
        if self.sharded_before or (posted and self.syncing):
            return unit.shard
        if self.resident or posted:
            return unit.whole  # accumulated unsharded (upcast under mixed precision)
        return 0


@by_identity(256)
def _grads_table(
    profile: Profile, sharding: Sharding, phase: str, accumulation_steps: int
) -> _GradsTable:
    resident = phase == PHASE_GRADS_RESIDENT
    # a pipeline stage reduces after its schedule: no unit syncs during a backward
    every = syncs_every_micro_step(sharding, accumulation_steps)
    every = every and not sharding.reduce_after_schedule
    syncing = (every or resident) and not sharding.reduce_after_schedule
    # accumulated sharded, in place (the reserve reads the same fact: fsdp_shards_resident)
    sharded_before = resident and fsdp_shards_resident(sharding, accumulation_steps)
    units = tuple(_unit_grads(profile, sharding, layer.grad_bytes) for layer in profile.layers)
    root = _unit_grads(profile, sharding, fixed_grads_bytes(profile))
    tail = None
    root_params = root_params_bytes(profile)
    split = edge_split(profile, root_params, root.probed) if sharding.edge_units else None
    if split is not None:  # the root's part is the embeddings' unit, reduced last
        root = _unit_grads(profile, sharding, split[0].grads)
        tail = _unit_grads(profile, sharding, split[1].grads)
        root_params = _edge_gathered(profile, split[0])
    table = _GradsTable(resident, syncing, sharded_before, units, root, tail, root_params, (), ())
    unposted, posted = [0], [0]
    for unit in units:
        unposted.append(unposted[-1] + table.held(unit, False))
    for unit in reversed(units):
        posted.append(posted[-1] + table.held(unit, True))
    posted.reverse()
    return dataclasses.replace(table, unposted=tuple(unposted), posted=tuple(posted))


def fsdp_grads_bytes(
    profile: Profile, sharding: Sharding, phase: str, index: int, accumulation_steps: int
) -> int:
    """Gradient bytes one FSDP2 rank holds at a segment, reduce-scatter buffers included, at
    the segment's highest moment. Read from FSDP2 (torch 2.13,
    ``torch/distributed/fsdp/_fully_shard/``) and measured op by op on 2 gloo ranks:

    * units reduce in backward order (the layers last to first, the root last, from the
      final callback ``FSDPState._root_post_backward_final_callback``: its inputs need no
      gradient);
    * ``FSDPParamGroup.post_backward`` of a unit that reduces copies its unsharded gradients
      into a padded reduce-scatter input (``foreach_reduce``, in ``reduce_dtype``), frees
      them, and keeps the input alive until the next unit's ``post_backward``
      (``reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` = 1); the output is
      the rank's new sharded gradient, or is added into the one it already has and freed;
    * a unit that does not reduce (``set_requires_gradient_sync(False)``) keeps its
      gradients unsharded; under a mixed-precision policy ``to_accumulated_grad_if_needed``
      upcasts them to ``reduce_dtype`` in a separate tensor, and later micro-steps'
      compute-dtype gradients land in a fresh ``.grad`` and are added into it at the
      unit's ``post_backward`` (``accumulate_unsharded_grad_if_needed``);
    * the root's gradients, computed during the backward, wait unsharded for the end.

    A unit's ``post_backward`` (its reduce-scatter input next to its unsharded gradients,
    then next to its output) counts in the segment after its backward. Not modelled: a
    unit's own new gradients during its backward, which the probe holds too (though after
    the first micro-step it adds each into ``.grad`` at once, while a rank with a separate
    accumulator keeps them to the unit's ``post_backward``)."""
    segments = profile.timeline[phase]
    segment = segments[index]
    h, n = segment.held, len(profile.layers)
    started = backward_started(segments, index)
    table = _grads_table(profile, sharding, phase, accumulation_steps)
    resident, syncing, sharded_before = table.resident, table.syncing, table.sharded_before
    mixed = mixed_precision_params(profile, sharding)
    units, root, tail, root_params = table.units, table.root, table.tail, table.root_params
    held = table.held

    # The root's gradients of this micro-step, from the backward's start to its end (all of
    # them: the profile does not say which fixed parts run before the layers). They land
    # in a fresh .grad but in the first micro-step, in fp32 FSDP without sharding, where
    # they are added in place as the probe adds them.
    root_fresh = (
        root.probed if started and h < n and (mixed or sharded_before or not resident) else 0
    )

    def steady(first_posted: int) -> int:
        """Held when layers ``first_posted`` .. n-1 have run their post_backward: their
        shards or unsharded gradients, the others', the root's, and the last reduce-scatter
        input, kept until the next post_backward."""
        total = table.unposted[first_posted] + table.posted[first_posted]
        total += held(root, False) + root_fresh
        if tail is not None:  # its post_backward ran inside the head's segment
            total += held(tail, started)
        if syncing and first_posted < n:
            total += units[first_posted].scatter_input
        elif syncing and tail is not None and started:
            total += tail.scatter_input  # kept until the last block's post_backward
        return total

    if not started:
        if tail is not None and h == n and syncing and profile.ddp_refused is not None:
            return steady(n) + tail_reduced_in_forward(tail)
        return steady(n)
    if segment.active == "bwd":
        return steady(h + 1)
    # Right after the backward of layer h: its post_backward ran as its input's gradient was
    # computed (just before the probe's boundary, where the residual stream's gradient is
    # added in).
    moments = [
        steady(h),
        *post_backward_moments(steady(h), units[h], syncing, sharded_before, resident, mixed),
    ]
    if h == 0:  # the root's post_backward, from the final callback at the backward's end
        base = steady(h) - held(root, False) - root_fresh
        if syncing:
            base -= units[0].scatter_input if n else 0  # released before the root's
            base -= root_params  # resharded first
            unsharded = root.whole if resident and not sharded_before else root.probed
            moments.append(base + unsharded + root.scatter_input)
            old_shard = root.shard if sharded_before else 0  # the output is added into it
            moments.append(base + old_shard + reduce_output_bytes(root))
        elif mixed:
            moments.append(steady(h) + root.whole)
        if sharding.reduce_after_schedule and resident:
            moments.extend(reduce_after_schedule_moments(steady(h), [*reversed(units), root]))
    return max(moments)
