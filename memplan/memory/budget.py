"""The reserve and the budget: what the CUDA context and allocator take beyond allocated bytes, the
safety margin, and the allocated limit a plan must fit. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memplan.devices import DeviceSpec, label_has_capacity
from memplan.memory.sharding import (
    Sharding,
    fsdp_sharded_grads_bytes,
    fsdp_shards_resident,
    gathered_edge_bytes,
    gathered_root_bytes,
    gathered_unit_bytes,
)
from memplan.profile import Profile
from memplan.units import MiB

# With no measurement, the CUDA context (driver state, cuBLAS/cuDNN kernels and workspaces
# loaded by PyTorch) takes a few hundred MiB: about 300-600 MiB on A100/H100 with CUDA 12
# lazy loading, as nvidia-smi shows for a process that has run one matmul and one conv.
# 512 MiB is the conservative middle of that range. It is device memory, but not the
# caching allocator's: torch.cuda.max_memory_reserved does not count it.
DEFAULT_CONTEXT_BYTES = 512 * MiB
# The caching allocator's own bytes beyond the allocated ones (torch 2.13
# c10/core/AllocatorConfig.h, used by c10/cuda/CUDACachingAllocator.cpp): every request is
# rounded up to 512 B (kMinBlockSize); requests up to 1 MiB (kSmallSize) are carved from
# 2 MiB segments (kSmallBuffer), 1-10 MiB ones (below kMinLargeAlloc) from 20 MiB segments
# (kLargeBuffer), larger ones rounded up to 2 MiB (kRoundLarge); a freed block stays
# reserved and is split for later requests, so a segment can hold free pieces too small for
# the next request (fragmentation). Rounding alone is under 2 MiB per live tensor, under 2%
# for tensors of 100 MiB and more; fragmentation depends on the order of sizes. Without a
# measurement memplan charges 5% of the allocated peak for both (an assumption, not
# measured here: no GPU), as before.
DEFAULT_FRAGMENTATION_FRACTION = 0.05
# NCCL's buffers: NCCL allocates them itself (cudaMalloc, outside PyTorch's allocator, so
# max_memory_reserved does not show them): per communicator and channel, a send and a
# receive buffer of NCCL_BUFFSIZE, 4 MiB by default (NCCL user guide, "Environment
# Variables": NCCL_BUFFSIZE). memplan assumes 16 channels (NCCL uses up to 32 on NVLink
# systems, fewer on PCIe): 128 MiB per communicator a rank belongs to.
NCCL_BUFFSIZE_BYTES = 4 * MiB
NCCL_CHANNELS = 16
NCCL_COMMUNICATOR_BYTES = 2 * NCCL_CHANNELS * NCCL_BUFFSIZE_BYTES
DEFAULT_MARGIN = 0.03
"""Fraction of the budget kept free by default (safety margin against run-to-run noise)."""


# --------------------------------------------------------------------------- reserve, budget
@dataclass(frozen=True, kw_only=True, slots=True)
class Reserve:
    """Device memory the model's tensors do not account for: CUDA context and allocator."""

    fixed_bytes: int
    """CUDA context plus the measured allocator overhead (bytes), plus the FSDP2 stream
    pools and NCCL buffers (the fields below, already included)."""
    fragmentation_fraction: float = 0.0
    """Extra allocator overhead as a fraction of the allocated peak (when not measured)."""
    source: str = ""
    """Where the numbers come from, for the plan's reasons."""
    outside_allocator_bytes: int = 0
    """The part of ``fixed_bytes`` PyTorch's caching allocator does not hold (the CUDA
    context, NCCL's buffers): device memory ``torch.cuda.max_memory_reserved`` leaves out."""
    stream_bytes: int = 0
    """FSDP2's all-gather and reduce-scatter stream pools (``fsdp_stream_bytes``)."""
    nccl_bytes: int = 0
    """NCCL's buffers (``NCCL_COMMUNICATOR_BYTES`` per communicator)."""

    def reserved_bytes(self, allocated_bytes: int) -> int:
        """What ``torch.cuda.max_memory_reserved`` would show for an allocated peak: the
        allocated bytes plus the allocator's share of the reserve (no context, no NCCL)."""
        return allocated_bytes + self.bytes_for(allocated_bytes) - self.outside_allocator_bytes

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
    return env.device == "meta" and label_has_capacity(env.device_profile)


def fsdp_stream_bytes(
    profile: Profile, sharding: Sharding | None, accumulation_steps: int = 1
) -> int:
    """FSDP2's stream pools. The caching allocator reuses a freed block only for the stream
    that allocated it (torch 2.13 c10/cuda/CUDACachingAllocator.cpp ``get_free_block``: a
    block of another stream is not a match), so what FSDP2 allocates outside the default
    stream stays reserved beside what the default stream needs:

    * the all-gather stream's pool: one unit's gathered parameters, the largest unit's (the
      root's too: embeddings and head, under torchtitan the largest unit of a Llama).
      ``foreach_all_gather`` allocates the flat all-gather output in
      ``all_gather_copy_in_stream`` (torch 2.13 _fsdp_collectives.py); the unsharded
      parameters it is copied into are the default stream's and counted as allocated;
    * the reduce-scatter stream's pool: every unit's reduce-scatter output, which the sharded
      gradients are views of (``foreach_reduce``: "the RS output is allocated in the RS
      stream and used in the default stream (for optimizer)"), freed together by
      ``zero_grad`` and then reusable by no forward. pytorch/pytorch#129721 (June 2024,
      before torch 2.6) moved the reduce-scatter *input* to the default stream for this
      reason and left the outputs there ("we iteratively allocate them through backward
      and free them altogether after optimizer"), so the input is allocated bytes and not
      a pool. With the shards resident across micro-steps (``fsdp_shards_resident``) the
      allocated peak holds them already, and the pool adds nothing.

    Zero unless FSDP over two or more ranks."""
    if sharding is None or sharding.strategy != "fsdp" or sharding.world_size < 2:
        return 0
    edge = gathered_edge_bytes(profile) if sharding.edge_units else None
    edge = edge or (gathered_root_bytes(profile),)
    gathered = max([*edge] + [gathered_unit_bytes(profile, i) for i in range(len(profile.layers))])
    if fsdp_shards_resident(sharding, accumulation_steps):
        return gathered
    return gathered + fsdp_sharded_grads_bytes(profile, sharding)


def reserve_for(
    profile: Profile,
    device_spec: DeviceSpec | None = None,
    sharding: Sharding | None = None,
    communicators: int | None = None,
    accumulation_steps: int = 1,
) -> Reserve:
    """The CUDA reserve, nothing off CUDA: the CUDA context (measured, else
    ``DEFAULT_CONTEXT_BYTES``); the allocator's rounding and fragmentation (measured, else
    ``DEFAULT_FRAGMENTATION_FRACTION`` of the allocated peak); FSDP2's stream pools
    (``fsdp_stream_bytes``, for ``accumulation_steps`` micro-steps); NCCL's buffers,
    ``NCCL_COMMUNICATOR_BYTES`` for each of ``communicators`` (default: one when
    ``sharding`` spans two or more ranks)."""
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
    streams = fsdp_stream_bytes(profile, sharding, accumulation_steps)
    if communicators is None:
        communicators = 1 if sharding is not None and sharding.world_size > 1 else 0
    nccl = communicators * NCCL_COMMUNICATOR_BYTES
    extra = streams + nccl
    if streams:
        parts.append(f"FSDP2 stream pools {streams / MiB:,.0f} MiB")
    if nccl:
        parts.append(f"NCCL buffers {nccl / MiB:,.0f} MiB ({communicators} communicators)")
    outside = int(context) + nccl
    if allocator is None:
        parts.append(f"allocator {DEFAULT_FRAGMENTATION_FRACTION:.0%} of the peak (default)")
        return Reserve(
            fixed_bytes=int(context) + extra,
            fragmentation_fraction=DEFAULT_FRAGMENTATION_FRACTION,
            source=", ".join(parts),
            outside_allocator_bytes=outside,
            stream_bytes=streams,
            nccl_bytes=nccl,
        )
    parts.append("measured allocator overhead")
    return Reserve(
        fixed_bytes=int(context) + int(allocator) + extra,
        source=", ".join(parts),
        outside_allocator_bytes=outside,
        stream_bytes=streams,
        nccl_bytes=nccl,
    )


def margin_problem(margin: object) -> str | None:
    """Why ``margin`` is not a safety margin (a fraction in [0, 1)), or None when it is."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        return f"margin must be a fraction in [0, 1), got {margin!r}"
    return None


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
