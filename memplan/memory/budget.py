"""The reserve and the budget: what the CUDA context and allocator take beyond allocated bytes, the
safety margin, and the allocated limit a plan must fit. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memplan.devices import DeviceSpec
from memplan.profile import Profile
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
