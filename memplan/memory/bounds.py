"""The step as bounds on prefix savings (StepBounds): what the solver's DP reads, and the least
peak any checkpoint set reaches. No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from memplan.devices import DeviceSpec
from memplan.memory.budget import reserve_for
from memplan.memory.peak import Peak, optimizer_point_bytes, rank_segments, step_peak
from memplan.memory.sharding import (
    SINGLE,
    Sharding,
    sharding_for,
)
from memplan.memory.terms import (
    NO_BOUND,
    cast_charge_bytes,
    has_autocast_casts,
    mode_savings_bytes,
    offload_host_bytes,
    phases_for,
    savings_bytes,
    shared_charge_bytes,
    shared_own_bytes,
)
from memplan.memory.tops import held_layout, segment_tops_bytes, segment_tops_float
from memplan.modes import FULL, KEEP, MODES, OFFLOAD
from memplan.plan import Plan
from memplan.profile import Profile, Segment

# --------------------------------------------------------------------------- bounds
_INFEASIBLE = 1 << 100
"""A need no prefix saving meets: a layer with no allowed mode."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBounds:
    """The step peak at one micro-batch reduced to per-layer bounds, for the solver.

    With ``P_h`` the savings of the layers 0 .. h-1 in their modes, the allocated step peak
    of a mode assignment is the largest of ``optimizer_bytes``, ``none_bytes[h] − P_h``
    (h = 0 .. n) and, for each layer h, ``active_bytes(mode of h, h) − P_h``. This is the
    segment formula with the maxima taken per ``held`` first, over the same walk of the
    step as :func:`step_points` (``rank_segments``); it is equal to :func:`step_peak` to
    the byte. ``plain_bytes``/``ckpt_bytes``/``savings`` are the keep and
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
    barred: frozenset[tuple[int, str]] = frozenset()
    """(layer, mode) pairs not offered although the mode is: the solver bars ``selective``
    where the probe measured it no faster than ``full`` (memplan.solver)."""

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
        modes = self.modes
        if self.barred:
            modes = tuple(m for m in modes if (h, m) not in self.barred)
        if h in forced_in:
            return tuple(m for m in modes if m != KEEP)
        return modes

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
    none = [NO_BOUND] * (n + 1)
    plain = [NO_BOUND] * n
    ckpt = [NO_BOUND] * n
    others = {m: [NO_BOUND] * n for m in extra}
    # Shared inputs (memory.terms): each layer taking one is charged all of it, and a
    # checkpointed layer in its backward what its own checkpoint keeps. Never less than
    # step_peak; equal without shared inputs.
    shared = bool(profile.shared_inputs)
    charge = shared_charge_bytes(profile, micro_batch)
    # Autocast's weight casts (memory.terms): a checkpointed layer's backward is charged every
    # held layer's, as if all were kept. Never less than step_peak.
    casts = has_autocast_casts(profile)
    # Each phase's segment tops in each mode at once (memory.tops), then the maxima by held
    # (in arrays where there is no shared input to add segment by segment).
    bound_of = {KEEP: plain, FULL: ckpt, **others}
    if (
        sharding == SINGLE
        and not shared
        and not casts
        and _held_maxima(profile, micro_batch, accumulation_steps, none, bound_of)
    ):
        pass
    else:
        tops: dict[str, dict[str, list[int]]] = {}
        for phase, index, segment, adjust in _step_segments(profile, accumulation_steps, sharding):
            if phase not in tops:
                segments = profile.timeline[phase]
                tops[phase] = {m: segment_tops_bytes(segments, micro_batch, m) for m in bound_of}
            h = segment.held
            top = tops[phase][KEEP][index] + adjust
            if segment.active == "none":
                none[h] = max(none[h], top)
                continue
            plain[h] = max(plain[h], top)
            adjust += shared_own_bytes(profile, segment, micro_batch) if shared else 0
            for m, bound in bound_of.items():
                if m != KEEP:
                    cast = cast_charge_bytes(profile, segment, m) if casts else 0
                    bound[h] = max(bound[h], tops[phase][m][index] + adjust + cast)
    return StepBounds(
        micro_batch=micro_batch,
        accumulation_steps=accumulation_steps,
        savings=_less(savings_bytes(profile, micro_batch), charge),
        none_bytes=tuple(none),
        plain_bytes=tuple(plain),
        ckpt_bytes=tuple(ckpt),
        optimizer_bytes=optimizer_point_bytes(profile, micro_batch, sharding),
        modes=modes,
        mode_bytes={m: tuple(v) for m, v in others.items()},
        mode_savings={m: _less(mode_savings_bytes(profile, micro_batch, m), charge) for m in extra},
        host_bytes=offload_host_bytes(profile, micro_batch) if OFFLOAD in modes else (),
        host_limit_bytes=host_limit_bytes,
    )


def _step_segments(
    profile: Profile, accumulation_steps: int, sharding: Sharding
) -> Iterator[tuple[str, int, Segment, int]]:
    """Every segment of the step's phases with the bytes a rank adds to it: none on a
    single device, the strategy's adjustment otherwise (memory.sharding)."""
    if sharding != SINGLE:
        yield from rank_segments(profile, accumulation_steps, sharding)
        return
    for phase in phases_for(accumulation_steps):
        for index, segment in enumerate(profile.timeline[phase]):
            yield phase, index, segment, 0


def _held_maxima(
    profile: Profile,
    micro_batch: int,
    accumulation_steps: int,
    none: list[int],
    active: dict[str, list[int]],
) -> bool:
    """The single-process maxima by ``held`` of ``step_bounds`` in array operations: fills
    ``none`` and ``active`` (per mode) and returns True, or returns False, changing nothing,
    where memory.tops cannot give float tops or a top is too large for int64 (the
    one-by-one path then). ``none`` and ``active`` come in holding NO_BOUND only. The
    maximum is taken before rounding up: ceil is monotone, so ``ceil(max x) == max(ceil x)``."""
    n = len(active[KEEP])
    tops = {}
    for phase in phases_for(accumulation_steps):
        segments = profile.timeline[phase]
        for mode in active:
            top = segment_tops_float(segments, micro_batch, mode)
            if top is None:
                return False
            tops[(phase, mode)] = top
    none_top = np.full(n + 1, -np.inf)
    active_top = {mode: np.full(n, -np.inf) for mode in active}
    for phase in phases_for(accumulation_steps):
        held, is_active = held_layout(profile.timeline[phase])
        idle = ~is_active
        np.maximum.at(none_top, held[idle], tops[(phase, KEEP)][idle])
        for mode, top in active_top.items():
            np.maximum.at(top, held[is_active], tops[(phase, mode)][is_active])
    rounded = []
    for out, top in ((none, none_top), *((active[m], t) for m, t in active_top.items())):
        seen = top > -np.inf
        ceiling = np.ceil(np.where(seen, top, 0.0))
        if ceiling.size and not float(np.abs(ceiling).max()) < _INT64_SAFE:
            return False
        rounded.append((out, ceiling.astype(np.int64).tolist(), seen.tolist()))
    for out, values, seen in rounded:  # the lists hold NO_BOUND only until now
        out[:] = [value if here else NO_BOUND for value, here in zip(values, seen, strict=True)]
    return True


_INT64_SAFE = float(1 << 62)


def _less(savings: tuple[int, ...], charge: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s - c for s, c in zip(savings, charge, strict=True))


def bounds_peak_bytes(bounds: StepBounds, checkpointed: Iterable[int] | Mapping[int, str]) -> int:
    """Allocated step peak of a checkpoint set (full) or a mode assignment, from the bounds
    (equals step_peak's)."""
    chosen: Iterable[int] | Mapping[int, str] = (
        checkpointed if isinstance(checkpointed, Mapping) else frozenset(checkpointed)
    )
    best = bounds.optimizer_bytes
    prefix = 0
    none_bytes, plain_bytes = bounds.none_bytes, bounds.plain_bytes
    modes = chosen if isinstance(chosen, Mapping) else dict.fromkeys(chosen, FULL)
    for h in range(len(plain_bytes)):
        mode = modes.get(h)
        if mode is None or mode == KEEP:
            best = max(best, none_bytes[h] - prefix, plain_bytes[h] - prefix)
        else:
            best = max(best, none_bytes[h] - prefix, bounds.active(mode, h) - prefix)
            prefix += bounds.saving(mode, h)
    return max(best, none_bytes[-1] - prefix)


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
    none_bytes = bounds.none_bytes
    need[n] = none_bytes[n] - limit_bytes
    # each mode's (active, saving) series, read by index in the loop
    series = {
        mode: (
            [bounds.active(mode, h) for h in range(n)],
            [bounds.saving(mode, h) for h in range(n)],
        )
        for mode in bounds.modes
    }
    every = bounds.modes
    plain = not bounds.barred and not forced_in and not forced_out
    for h in range(n - 1, -1, -1):
        none_need = none_bytes[h] - limit_bytes
        after = need[h + 1]
        options = [
            max(none_need, active[h] - limit_bytes, after - saving[h])
            for active, saving in (
                series[mode]
                for mode in (every if plain else bounds.allowed(h, forced_in, forced_out))
            )
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
    # What a binary search on the limit over (lo, hi] finds, in one pass: every need of
    # prefix_saving_bounds at limit L is its need at limit 0 less L (the limit enters each
    # term once, subtracted), so some assignment fits under L iff L >= the optimizer step
    # and L >= the floor at 0 with limit 0. A layer with no allowed mode fits under none.
    if any(not bounds.allowed(h, forced_in, forced_out) for h in range(n)):
        return hi
    floor = feasible_floor_bytes(bounds, 0, forced_in=forced_in, forced_out=forced_out)
    return min(hi, max(lo + 1, bounds.optimizer_bytes, floor[0]))


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
        reserve=reserve_for(
            profile, device_spec, sharding_for(plan), accumulation_steps=plan.accumulation_steps
        ),
        sharding=sharding_for(plan),
    )
