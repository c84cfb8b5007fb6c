"""The step-time model: how long one optimizer step takes for a plan. No torch.

    step_seconds = k × (fixed(b) + Σ_i (fwd_i(b) + bwd_i(b)) + Σ_{i ∉ keep} extra_i(b, mode_i))
                   + optimizer_step
    extra_i(b, full)      = the measured recompute time of layer i (``recompute_seconds``;
                            one forward, fwd_i(b), where none was measured, as on roofline)
    extra_i(b, selective) = the measured extra time under selective checkpointing
    extra_i(b, offload)   = 2 × host bytes / host-link bandwidth (:func:`offload_seconds`)

(``step_seconds`` and ``MicroStepTimes.mode_seconds``.) A plan's collectives are not in
this sum: the solver adds ``communication_seconds`` of its strategy's bytes to each option
(memplan.solver.options).

Times come from the profile's measured affine fits ("measured"), or, for a profile probed
on ``meta`` being planned for another GPU than the one its times were computed for, from
FLOPs and bytes against the device spec ("roofline"). A measured time of a real run on the
target hardware is always preferred; the roofline is for ranking plans before one exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from memplan.collective import Collective
from memplan.devices import DeviceSpec
from memplan.modes import FULL, KEEP, SELECTIVE
from memplan.profile import Affine, Layer, Profile

TimingSource = Literal["measured", "roofline", "rescaled"]
TimingMode = Literal["auto", "measured", "roofline"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroStepTimes:
    """Seconds of each part of a micro-step at one micro-batch size."""

    micro_batch: int
    fixed_seconds: float
    """Everything outside the candidate layers (fwd + bwd of embeddings, head, loss)."""
    fwd_seconds: tuple[float, ...]
    """Per layer: one forward (and so one recompute)."""
    bwd_seconds: tuple[float, ...]
    optimizer_step_seconds: float
    source: TimingSource
    recompute_seconds: tuple[float, ...] = ()
    """Per layer: extra time per micro-step when checkpointed (measured); empty: one
    forward (``fwd_seconds``), as for roofline times."""
    selective_seconds: tuple[float, ...] = ()
    """Per layer: extra time per micro-step under selective checkpointing (measured);
    empty when not measured."""
    offload_seconds: tuple[float, ...] = ()
    """Per layer: extra time per micro-step when offloaded (modelled from the host link:
    :func:`offload_seconds`); empty when offload is not planned."""

    def checkpoint_seconds(self, layer: int) -> float:
        return self.recompute_seconds[layer] if self.recompute_seconds else self.fwd_seconds[layer]

    def mode_seconds(self, layer: int, mode: str) -> float:
        """Extra time per micro-step of ``layer`` in ``mode``."""
        if mode == KEEP:
            return 0.0
        if mode == FULL:
            return self.checkpoint_seconds(layer)
        series = self.selective_seconds if mode == SELECTIVE else self.offload_seconds
        if not series:
            raise ValueError(f"no {mode} times for this plan")
        return series[layer]


def _modes(checkpointed: Iterable[int] | Mapping[int, str]) -> list[tuple[int, str]]:
    if isinstance(checkpointed, Mapping):
        return [(i, m) for i, m in checkpointed.items() if m != KEEP]
    return [(i, FULL) for i in checkpointed]


def seconds_at(value: Affine, micro_batch: int) -> float:
    """A fitted time at ``micro_batch``: a fit with a negative intercept can dip below zero
    at tiny sizes; time cannot."""
    return max(value.at(micro_batch), 0.0)


def _structure_key(layer: Layer) -> tuple:
    """Layers with equal keys do the same work: same type, parameters, FLOPs and bytes."""
    return (
        layer.module_type,
        layer.params_trainable_bytes,
        layer.params_frozen_bytes,
        layer.fwd_flops.intercept,
        layer.fwd_flops.slope,
        layer.saved_bytes.intercept,
        layer.saved_bytes.slope,
    )


def layer_groups(profile: Profile) -> list[list[int]]:
    """The profile's layers by identical structure (``_structure_key``): each group's
    indices, ascending; the groups in order of their first layer."""
    groups: dict[tuple, list[int]] = {}
    for index, layer in enumerate(profile.layers):
        groups.setdefault(_structure_key(layer), []).append(index)
    return list(groups.values())


def pooled_layer_seconds(
    profile: Profile,
) -> tuple[list[Affine], list[Affine], list[Affine], list[Affine]]:
    """Per layer (fwd, bwd, recompute, selective recompute) time fits, each the mean over
    the layers of identical structure; recompute (selective) is empty when the profile has
    no measured recompute (selective) times.

    Repeated blocks do the same work, so their measured times differ only by noise (one
    timed run each, on a machine doing other things). Left alone, that noise decides which
    of several identical blocks to checkpoint; pooled, the choice is made on real
    differences and ties go to the earliest layers."""
    fwd = [layer.fwd_seconds for layer in profile.layers]
    bwd = [layer.bwd_seconds for layer in profile.layers]
    measured = [layer.recompute_seconds for layer in profile.layers]
    recompute = measured if all(r is not None for r in measured) else []
    sel = [layer.selective_recompute_seconds for layer in profile.layers]
    selective = sel if sel and all(r is not None for r in sel) else []
    for members in layer_groups(profile):
        if len(members) < 2:
            continue
        for series in (fwd, bwd, recompute, selective):
            if not series:
                continue
            mean = Affine(
                intercept=sum(series[i].intercept for i in members) / len(members),
                slope=sum(series[i].slope for i in members) / len(members),
            )
            for i in members:
                series[i] = mean
    return fwd, bwd, recompute, selective  # type: ignore[return-value]


_pooled: list[tuple[Profile, tuple]] = []
"""The last profile's ``pooled_layer_seconds`` (the solver asks at every micro-batch)."""


def measured_times(profile: Profile, micro_batch: int) -> MicroStepTimes:
    if not _pooled or _pooled[0][0] is not profile:
        _pooled[:] = [(profile, pooled_layer_seconds(profile))]
    fwd, bwd, recompute, selective = _pooled[0][1]
    return MicroStepTimes(
        micro_batch=micro_batch,
        fixed_seconds=seconds_at(profile.step_fixed_seconds, micro_batch),
        fwd_seconds=tuple(seconds_at(value, micro_batch) for value in fwd),
        bwd_seconds=tuple(seconds_at(value, micro_batch) for value in bwd),
        recompute_seconds=tuple(seconds_at(value, micro_batch) for value in recompute),
        selective_seconds=tuple(seconds_at(value, micro_batch) for value in selective),
        optimizer_step_seconds=seconds_at(profile.optimizer_step_seconds, micro_batch),
        source="measured",
    )


def selective_slower_layers(times: MicroStepTimes) -> tuple[int, ...]:
    """Layers whose measured selective checkpointing costs at least what full recompute
    does (in whole picoseconds, as the solver compares). Full frees more (only the inputs
    stay), so selective is never worth it there; on a CPU, where selective sends every op
    of a layer through a Python dispatch mode in forward and in recompute, small layers are
    like that. The solver does not offer selective on them."""
    if not times.selective_seconds:
        return ()
    return tuple(
        i
        for i in range(len(times.fwd_seconds))
        if to_picoseconds(times.mode_seconds(i, SELECTIVE))
        >= to_picoseconds(times.mode_seconds(i, FULL))
    )


def achievable_flops(spec: DeviceSpec, precision: str) -> float:
    """FLOP/s that large GEMMs reach: the peak times the spec's matmul efficiency (its
    float8 GEMMs' for ``float8``)."""
    if precision == "float8":
        return spec.peak_flops(precision) * spec.efficiency.float8_matmul_efficiency
    return spec.peak_flops(precision) * spec.efficiency.matmul


def achievable_bandwidth(spec: DeviceSpec) -> float:
    """Bytes per second that memory-bound ops reach: the datasheet bandwidth times the
    spec's memory efficiency."""
    return spec.memory_bandwidth * spec.efficiency.memory


def roofline_seconds(flops: float, bytes_moved: float, spec: DeviceSpec, precision: str) -> float:
    """max(compute time, memory time) against the spec's achievable rates (peaks times the
    measured efficiencies)."""
    compute = flops / achievable_flops(spec, precision)
    memory = bytes_moved / achievable_bandwidth(spec)
    return max(compute, memory, 0.0)


def recompute_seconds(
    times: MicroStepTimes, checkpointed: Iterable[int] | Mapping[int, str]
) -> float:
    """Extra time per micro-step of checkpointing (a set: full; a mapping: per mode):
    measured per layer where the profile has it, else one more forward of every fully
    checkpointed layer."""
    return sum(times.mode_seconds(i, m) for i, m in _modes(checkpointed))


def micro_step_seconds(
    times: MicroStepTimes, checkpointed: Iterable[int] | Mapping[int, str] = ()
) -> float:
    plain = times.fixed_seconds + sum(times.fwd_seconds) + sum(times.bwd_seconds)
    return plain + recompute_seconds(times, checkpointed)


def step_seconds(
    times: MicroStepTimes,
    accumulation_steps: int,
    checkpointed: Iterable[int] | Mapping[int, str] = (),
) -> float:
    """One optimizer step: ``accumulation_steps`` micro-steps, then the optimizer."""
    return (
        accumulation_steps * micro_step_seconds(times, checkpointed) + times.optimizer_step_seconds
    )


# Whole picoseconds, so that plans are compared exactly (sums of floats in different orders
# could make equal plans unequal and break the solver's tie rules). 1 ps is far below any
# measured time's noise.
PICOSECONDS_PER_SECOND = 10**12


def to_picoseconds(seconds: float) -> int:
    return round(seconds * PICOSECONDS_PER_SECOND)


def mode_picoseconds(times: MicroStepTimes, mode: str) -> list[int]:
    """``to_picoseconds(times.mode_seconds(i, mode))`` for every layer i (``np.rint`` rounds
    half to even as ``round`` does, on the same product)."""
    n = len(times.fwd_seconds)
    if mode == KEEP:
        return [0] * n
    if n:
        times.mode_seconds(0, mode)  # its error, for a mode with no times
    series = (
        times.recompute_seconds or times.fwd_seconds
        if mode == FULL
        else times.selective_seconds
        if mode == SELECTIVE
        else times.offload_seconds
    )
    with np.errstate(all="ignore"):
        rounded = np.rint(np.asarray(series, dtype=np.float64) * PICOSECONDS_PER_SECOND)
    if len(series) != n or (rounded.size and not float(np.abs(rounded).max()) < 2.0**62):
        return [to_picoseconds(times.mode_seconds(i, mode)) for i in range(n)]
    return rounded.astype(np.int64).tolist()


def step_picoseconds(
    times: MicroStepTimes,
    accumulation_steps: int,
    checkpointed: Iterable[int] | Mapping[int, str] = (),
) -> int:
    """:func:`step_seconds` with every term rounded to whole picoseconds: the solver's cost."""
    micro = (
        to_picoseconds(times.fixed_seconds)
        + sum(to_picoseconds(t) for t in times.fwd_seconds)
        + sum(to_picoseconds(t) for t in times.bwd_seconds)
        + sum(to_picoseconds(times.mode_seconds(i, m)) for i, m in _modes(checkpointed))
    )
    return accumulation_steps * micro + to_picoseconds(times.optimizer_step_seconds)


# --------------------------------------------------------------------------- offload
# (the host link's rate and the copies' seconds: memplan.host_link)
def with_offload(times: MicroStepTimes, seconds: tuple[float, ...]) -> MicroStepTimes:
    return dataclasses.replace(times, offload_seconds=seconds)


def with_optimizer_share(times: MicroStepTimes, world_size: int, sharded: bool) -> MicroStepTimes:
    """``times`` for a rank that steps 1/``world_size`` of the optimizer state (``sharded``:
    ZeRO-1 and up, FSDP): each rank runs the optimizer over its own partition only (ZeRO
    paper §5.1; FSDP2's sharded DTensor parameters), and the step is memory-bound, so its
    time scales with the bytes it updates."""
    if not sharded or world_size <= 1:
        return times
    return dataclasses.replace(
        times, optimizer_step_seconds=times.optimizer_step_seconds / world_size
    )


# --------------------------------------------------------------------------- communication
# Without a device spec (or one with no interconnect figure) collectives are timed at
# 10 GB/s per rank: PCIe 4.0 x16 after protocol overhead, and the order of a gloo ring over
# localhost or a fast NIC. The profiles/devices/*.yaml specs carry the real figure.
DEFAULT_INTERCONNECT_BYTES_PER_SECOND = 10e9


def ring_fraction(world_size: int) -> float:
    """Bytes each rank sends per byte of a ring all-gather or reduce-scatter: (w − 1) / w
    (an all-reduce is both: twice this). Patarasuk & Yuan 2009; NCCL's performance docs."""
    return (world_size - 1) / world_size if world_size > 1 else 0.0


def communication_bytes(strategy: str, world_size: int, collective: Collective) -> float:
    """Bytes one rank sends per optimizer step (ZeRO paper, Rajbhandari et al. 2020, §7:
    data parallelism all-reduces the gradients, 2Ψ; ZeRO-3 adds a parameter all-gather in
    forward and another in backward, 3Ψ), for the engines memplan emits:

    * ddp: one gradient all-reduce per step (``no_sync`` on the other micro-steps);
    * zero1: DDP's all-reduce plus ZeroRedundancyOptimizer's broadcast of the updated
      parameters (DeepSpeed stage 1 fuses it to reduce-scatter + all-gather: 2Ψ; the torch
      engine's larger figure is used);
    * zero2: DeepSpeed reduce-scatters the gradients every micro-step and all-gathers the
      updated parameters once;
    * fsdp: all-gathers the parameters in every micro-step's forward and backward, and
      reduce-scatters the gradients once (``set_requires_gradient_sync(False)`` before), or
      every micro-step with ``reduce_every_micro_step``. ``gathered_once``: a pipeline
      stage's FSDP (torchtitan: no reshard after forward under pipelining) gathers once per
      step: torch's ``PipelineStage`` keeps the parameters unsharded through every backward
      but the schedule's last (torch 2.13 ``distributed/pipelining/stage.py``,
      ``backward_maybe_with_nosync``: ``set_reshard_after_backward(False)``, reset by
      ``perform_reduce_grad`` after the schedule), so one all-gather, one reduce-scatter.

    ``collective.params_bytes`` is what the all-gathers move and ``grads_bytes`` what the
    reductions move (:class:`memplan.collective.Collective`).
    """
    if world_size <= 1:
        return 0.0
    ring = ring_fraction(world_size)
    k = collective.accumulation_steps
    params, grads = collective.params_bytes, collective.grads_bytes
    if strategy == "ddp":
        return 2 * ring * grads
    if strategy == "zero1":
        return 2 * ring * grads + ring * params
    if strategy == "zero2":
        return k * ring * grads + ring * params
    if strategy == "fsdp":
        return collective.gathers * ring * params + collective.reductions * ring * grads
    raise ValueError(f"unknown strategy {strategy!r}")


def interconnect_bandwidth(device_spec: DeviceSpec | None) -> tuple[float, str]:
    """Bytes per second between ranks and where the figure comes from: the spec's one-way
    link rate times its ``efficiency.interconnect`` (the bus bandwidth NCCL's ring
    collectives reach: nccl-tests ``busbw`` is bytes × (w − 1)/w over time, the quantity
    :func:`communication_bytes` counts), else memplan's default."""
    if device_spec is not None and device_spec.interconnect_bandwidth > 0:
        share = device_spec.efficiency.interconnect
        where = f"{device_spec.display_name} interconnect"
        if share < 1.0:
            where += f" at {share:.0%} of its line rate (NCCL bus bandwidth)"
        return device_spec.interconnect_bandwidth * share, where
    return DEFAULT_INTERCONNECT_BYTES_PER_SECOND, "memplan's default: no device spec gives one"


def communication_seconds(bytes_moved: float, bandwidth: float) -> float:
    """Time of the step's collectives, added to the step *without overlap*: an upper bound
    (DDP overlaps its all-reduce with backward, FSDP its all-gathers with compute), chosen
    so that more communication never looks free and ``auto`` prefers less sharding.
    ``bandwidth`` is what the collectives reach (:func:`interconnect_bandwidth`)."""
    return bytes_moved / bandwidth if bandwidth > 0 else 0.0


def fsdp_copy_bytes(world_size: int, collective: Collective) -> float:
    """Bytes one FSDP2 rank's copies around its collectives read and write per step, none
    in a probe's clock (torch 2.13 ``distributed/fsdp/_fully_shard/_fsdp_collectives.py``):
    ``foreach_all_gather``'s copy-in (``_foreach_copy_`` of the shards into the flat input),
    2·P/w; ``foreach_all_gather_copy_out`` (``split_with_sizes_copy`` of the output into the
    unsharded parameters), 2·P; ``foreach_reduce``'s copy-in (``chunk_cat`` of the gradients
    into the reduce-scatter input), 2·G. P: ``params_bytes`` as gathered; G: ``grads_bytes``
    as reduced (bf16 gradients read for an fp32 reduction counted at fp32, an upper bound).
    Counted per step as :func:`communication_bytes` counts the collectives."""
    if world_size <= 1:
        return 0.0
    params, grads = collective.params_bytes, collective.grads_bytes
    return (
        collective.gathers * 2 * (params + params / world_size) + collective.reductions * 2 * grads
    )


def fsdp_copy_seconds(copy_bytes: float, device_spec: DeviceSpec | None) -> float:
    """:func:`fsdp_copy_bytes` at the spec's achievable memory bandwidth; 0 with no spec."""
    if device_spec is None or copy_bytes <= 0:
        return 0.0
    return copy_bytes / achievable_bandwidth(device_spec)
