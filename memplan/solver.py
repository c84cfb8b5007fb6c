"""The solver: micro-batch × accumulation × checkpoint set, exact under the model. No torch.

For every data-parallel strategy asked for (``ddp``, ``zero1``, ``zero2``, ``fsdp``; ``auto``
tries them all) and every micro-batch ``b`` with ``b × k × world == target`` it finds the
checkpoint set of least recompute time whose predicted per-rank peak fits the budget (less
the margin), then picks the plan with the least predicted step time, communication included
(the effective batch is fixed, so that is the least time per effective batch). Ties: fewer
checkpointed layers, then the larger micro-batch; within one micro-batch, among sets of
equal time and size, the one checkpointing earlier layers (they are held longest).

``auto`` takes the least-sharded strategy for which any plan fits (sharding costs
communication, and every rank's state depends on every other), then the fastest plan of that
strategy; when a more sharded strategy would be faster (it fits with less recompute or a
larger micro-batch), the reasons say so and by how much.

FSDP with accumulation is tried both ways (``memplan.plan.GradSync``): reduce-scatter on the
last micro-step only (unsharded gradients until then, one reduce-scatter) and on every
micro-step (sharded gradients, k reduce-scatters); the faster one that fits wins, and the
reasons give the other's peak and time. A profile probed with ``--mixed-precision params``
plans FSDP only: that is the engine whose mixed-precision policy it measured.

Why it is exact and fast (docs/design.md, "The solver"): with ``P_h`` the savings of the
checkpointed layers before layer h, every point of the step is a lower bound on a prefix
sum, ``P_h >= point − limit``, whose point depends only on whether layer h itself is
checkpointed (memplan.memory.StepBounds). So a left-to-right DP over layers whose state is
``P`` is exact: a state with more savings and less cost dominates. Each layer's cost is an
integer (picoseconds) and ties are broken through the same integer key, so the DP's choice
is exactly brute force's. States that cannot be completed are dropped (``R[h]``, exact), and
``P`` is capped where every completion is feasible, which merges states.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import accumulate
from operator import itemgetter

from memplan import memory, timing
from memplan.devices import DeviceSpec
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.memory import Peak, Reserve, Sharding, StepBounds
from memplan.modes import (
    FULL,
    KEEP,
    MODES,
    OFFLOAD,
    SELECTIVE,
    TIE_BITS,
    TIE_DIGIT,
    parse_modes,
)
from memplan.plan import GRAD_SYNCS, STRATEGIES, GradSync, ModelFingerprint, Plan, Prediction
from memplan.profile import Profile
from memplan.timing import MicroStepTimes, TimingMode
from memplan.units import format_bytes, format_seconds

__all__ = [
    "Candidate",
    "LeastPeak",
    "SolveRequest",
    "SolveRequestError",
    "SolveResult",
    "least_peak",
    "least_recompute_set",
    "solve",
]

_TIMING_MODES = ("auto", "measured", "roofline")
STRATEGY_CHOICES = (*STRATEGIES, "auto")


class SolveRequestError(BadInputError, ValueError):
    """A SolveRequest field is invalid (a ValueError naming the field; exit code 2)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveRequest:
    """What to plan for. Sizes are per rank; ``target_batch`` is the global effective batch."""

    target_batch: int
    """Effective batch: micro-batch × accumulation steps × world size, exactly."""
    budget_bytes: int
    """Device memory one rank may use."""
    world_size: int = 1
    """Data-parallel ranks."""
    strategy: str = "ddp"
    """``ddp``, ``zero1``, ``zero2``, ``fsdp``, or ``auto`` (the least-sharded strategy that
    fits; see the module doc)."""
    margin: float = memory.DEFAULT_MARGIN
    """Fraction of the budget kept free; predicted peaks must stay within the rest."""
    min_micro: int = 1
    max_micro: int | None = None
    """Largest micro-batch to consider; None: target_batch / world_size."""
    always_checkpoint: tuple[str, ...] = ()
    """Layer names (or globs) that are checkpointed in every plan."""
    never_checkpoint: tuple[str, ...] = ()
    """Layer names (or globs) that are never checkpointed."""
    bn_min_micro: int = 16
    """Smallest micro-batch for a model with BatchNorm (statistics use the micro-batch)."""
    allow_small_bn_micro: bool = False
    device_spec: DeviceSpec | None = None
    """GPU to plan for: adds the CUDA reserve, and times a meta profile by roofline."""
    device: str | None = None
    """Label for the plan's device; default: the spec's name, else the profile's device."""
    timing: TimingMode = "auto"
    """``auto``, ``measured`` or ``roofline`` (see memplan.timing.choose_timing_source)."""
    model_path: str | None = None
    """Model file named in the plan; default: the profile's (``path`` or ``path:factory``)."""
    profile_path: str = ""
    """The profile file named in the plan."""
    modes: tuple[str, ...] | None = None
    """Modes a layer may take (memplan.modes; ``keep`` is always allowed). None: every mode
    the profile and device support (``selective`` when the probe measured it, ``offload``
    when planning for CUDA)."""
    host_memory_bytes: int | None = None
    """Host memory the offloaded layers of one rank may take together; None: no limit."""

    def __post_init__(self) -> None:
        if self.modes is not None:
            object.__setattr__(self, "modes", parse_modes(self.modes))
        if self.host_memory_bytes is not None and (
            isinstance(self.host_memory_bytes, bool)
            or not isinstance(self.host_memory_bytes, int)
            or self.host_memory_bytes < 0
        ):
            raise SolveRequestError(
                f"host_memory_bytes must be a non-negative integer, got {self.host_memory_bytes!r}."
            )
        for name in ("target_batch", "world_size", "min_micro", "bn_min_micro", "budget_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SolveRequestError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_micro is not None:
            if isinstance(self.max_micro, bool) or not isinstance(self.max_micro, int):
                raise SolveRequestError(f"max_micro must be an integer, got {self.max_micro!r}.")
            if self.max_micro < self.min_micro:
                raise SolveRequestError(
                    f"max_micro ({self.max_micro}) must be >= min_micro ({self.min_micro})."
                )
        if not (isinstance(self.margin, (int, float)) and 0.0 <= self.margin < 1.0):
            raise SolveRequestError(f"margin must be a fraction in [0, 1), got {self.margin!r}.")
        for name in ("always_checkpoint", "never_checkpoint"):
            value = getattr(self, name)
            names = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(item, str) and item for item in names):
                raise SolveRequestError(f"{name} must be layer names, got {value!r}.")
            object.__setattr__(self, name, names)
        both = sorted(set(self.always_checkpoint) & set(self.never_checkpoint))
        if both:
            raise SolveRequestError(
                f"always_checkpoint and never_checkpoint both name {', '.join(both)}."
            )
        if self.strategy not in STRATEGY_CHOICES:
            raise SolveRequestError(
                f"strategy must be one of {', '.join(STRATEGY_CHOICES)}, got {self.strategy!r}."
            )
        if self.timing not in _TIMING_MODES:
            raise SolveRequestError(
                f"timing must be one of {', '.join(_TIMING_MODES)}, got {self.timing!r}."
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One row of the table behind the choice: the best plan at one micro-batch."""

    micro_batch: int
    accumulation_steps: int
    feasible: bool
    """Fits the budget and is allowed (not below the BatchNorm floor)."""
    fits: bool
    """Fits the budget (allowed or not)."""
    chosen: bool
    checkpoint_layers: tuple[str, ...]
    """Layers not kept in the least-cost assignment that fits; when nothing fits, in the
    assignment of least peak."""
    n_checkpointed: int
    peak_bytes: int
    """Predicted peak of that set (when nothing fits: the least any set needs)."""
    step_seconds: float
    samples_per_second: float
    peak_phase: str
    note: str
    """Why it was or was not chosen."""
    strategy: str = "ddp"
    """Data-parallel strategy of this row (one row per strategy and micro-batch)."""
    grad_sync: GradSync = "last_micro_step"
    """FSDP with accumulation: when gradients are reduce-scattered (one row per way)."""
    checkpoint: dict[str, str] = field(default_factory=dict)
    """Layer -> mode for the layers in ``checkpoint_layers``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveResult:
    plan: Plan
    candidates: tuple[Candidate, ...]
    """One row per micro-batch that divides the target, in increasing micro-batch."""
    usable_budget_bytes: int
    """Budget less the margin: the most a predicted peak may be."""
    reserve: Reserve
    timing_source: str


# --------------------------------------------------------------------------- the DP
Costs = Mapping[str, Sequence[int]]
"""Per mode other than keep: each layer's extra cost (whole picoseconds) in that mode."""


def _cap_bytes(
    bounds: StepBounds, limit: int, forced_in: frozenset[int], forced_out: frozenset[int]
) -> list[int]:
    """``cap[h]``: a prefix saving from which *every* allowed completion fits. States above
    it are interchangeable, so they are clipped to it and merged."""
    return memory.prefix_saving_bounds(
        bounds, limit, max, forced_in=forced_in, forced_out=forced_out
    )


def _efficient_mode(
    bounds: StepBounds, costs: Costs, h: int, modes: Sequence[str]
) -> tuple[str, Fraction] | None:
    """Layer h's mode of least cost per byte saved among ``modes`` that save bytes (ties:
    the larger saving, then MODES order), and that ratio."""
    best = None
    for mode in modes:
        saving = bounds.saving(mode, h) if mode != KEEP else 0
        if saving <= 0:
            continue
        ratio = Fraction(costs[mode][h], saving)
        if best is None or (ratio, -saving) < (best[1], -best[2]):
            best = (mode, ratio, saving)
    return None if best is None else (best[0], best[1])


def _fits(bounds: StepBounds, limit: int, assignment: Mapping[int, str]) -> bool:
    if memory.bounds_peak_bytes(bounds, assignment) > limit:
        return False
    return bounds.host_limit_bytes is None or (
        memory.host_total_bytes(bounds, assignment) <= bounds.host_limit_bytes
    )


def _greedy_cost(
    bounds: StepBounds,
    limit: int,
    costs: Costs,
    forced_in: frozenset[int],
    forced_out: frozenset[int],
) -> int | None:
    """Cost of some assignment that fits, or None: the forced layers plus the fewest layers
    of best cost per byte saved, each in its most efficient mode (binary search on how
    many). Only an upper bound for pruning the DP; its quality affects speed, never the
    answer."""
    n = len(bounds.plain_bytes)
    free: list[tuple[Fraction, int, str]] = []
    forced: dict[int, str] = {}
    for j in range(n):
        if j in forced_out:
            continue
        allowed = [m for m in bounds.allowed(j, forced_in, forced_out) if m != KEEP]
        best = _efficient_mode(bounds, costs, j, allowed)
        if j in forced_in:
            if not allowed:
                return None
            forced[j] = best[0] if best is not None else allowed[0]
        elif best is not None:
            free.append((best[1], j, best[0]))
    free.sort(key=lambda item: (item[0], item[1]))

    def assignment(m: int) -> dict[int, str]:
        return {**forced, **{j: mode for _, j, mode in free[:m]}}

    if not _fits(bounds, limit, assignment(len(free))):
        return None
    lo, hi = -1, len(free)  # fits(hi); smallest such m, assuming more layers never hurt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(bounds, limit, assignment(mid)):
            hi = mid
        else:
            lo = mid
    return sum(costs[mode][j] for j, mode in assignment(hi).items())


def _suffix_knapsacks(
    bounds: StepBounds, costs: Costs, forced_in: frozenset[int], forced_out: frozenset[int]
) -> list[tuple[list[int], list[int], list[tuple[int, int]]]]:
    """For each layer i: the layers i .. n-1 that can save bytes, by increasing cost per
    byte, with running sums of savings and costs. Each is one item: its largest saving at
    its least cost per byte over its modes (no mode does better, so this relaxes the
    choice). The least cost of saving D bytes with a fraction of an item allowed (the
    fractional knapsack, read off these sums) is a lower bound on the real least cost."""
    n = len(bounds.plain_bytes)
    out: list[tuple[list[int], list[int], list[tuple[int, int]]]] = [([], [], [])] * (n + 1)
    ratios: list[Fraction] = []
    items: list[tuple[int, int]] = []
    for i in range(n - 1, -1, -1):
        modes = [m for m in bounds.allowed(i, forced_in, forced_out) if m != KEEP]
        best = _efficient_mode(bounds, costs, i, modes)
        if best is not None and i not in forced_out:
            saving = max(bounds.saving(m, i) for m in modes)
            item_cost = math.floor(best[1] * saving)  # cost per byte no above any mode's
            ratio = Fraction(item_cost, saving)
            at = bisect_right(ratios, ratio)
            ratios.insert(at, ratio)
            items.insert(at, (item_cost, saving))
            out[i] = (
                list(accumulate(map(itemgetter(1), items))),
                list(accumulate(map(itemgetter(0), items))),
                list(items),
            )
        else:
            out[i] = out[i + 1]
    return out


def _pareto(merged: dict[tuple[int, int], int], host: bool) -> list[tuple[int, int, int]]:
    """The states (P, H, key) no other state beats: one with more saving P, no more host
    bytes H and no larger key is at least as good in every completion."""
    states: list[tuple[int, int, int]] = []
    if not host:
        for prefix, used in sorted(merged, reverse=True):
            key = merged[(prefix, used)]
            if not states or key < states[-1][2]:
                states.append((prefix, used, key))
        return states
    hosts: list[int] = []  # a staircase: host bytes rising, keys falling
    keys: list[int] = []
    for (prefix, used), key in sorted(merged.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        at = bisect_right(hosts, used)
        if at and keys[at - 1] <= key:
            continue
        states.append((prefix, used, key))
        end = at
        while end < len(hosts) and keys[end] >= key:
            end += 1
        hosts[at:end] = [used]
        keys[at:end] = [key]
    return states


def least_cost_modes(
    bounds: StepBounds,
    limit_bytes: int,
    costs: Costs,
    *,
    forced_in: frozenset[int] = frozenset(),
    forced_out: frozenset[int] = frozenset(),
    prune: bool = True,
) -> dict[int, str] | None:
    """The mode assignment (layer index -> mode, keep left out) of least total cost whose
    allocated step peak is at most ``limit_bytes`` and, with offload, whose host bytes stay
    within ``bounds.host_limit_bytes``; None when none fits. Layers take the modes of
    ``bounds.modes``; ``forced_in`` layers any but keep, ``forced_out`` ones keep only.
    Ties: fewer layers not kept, then the earliest differing layer in the mode first in
    memplan.modes.TIE_DIGIT (for keep/full alone: the lexicographically smallest index
    tuple). ``costs`` are non-negative integers. ``prune=False`` turns branch and bound
    off (same answer, slower: for tests)."""
    if bounds.optimizer_bytes > limit_bytes:
        return None
    floor = memory.feasible_floor_bytes(
        bounds, limit_bytes, forced_in=forced_in, forced_out=forced_out
    )
    if floor[0] > 0:
        return None
    n = len(bounds.savings)
    limit = limit_bytes
    cap = _cap_bytes(bounds, limit, forced_in, forced_out)
    host_limit = bounds.host_limit_bytes if bounds.host_binding else None
    use_host = host_limit is not None

    # Branch and bound. A state (P, cost) before layer i still has to raise P to at least
    # ``ahead[i] = max need of the points after layer i`` with layers i .. n-1, which costs
    # at least what the fractional knapsack says. States whose cost plus that bound exceeds
    # a known plan's cost cannot win.
    upper = _greedy_cost(bounds, limit, costs, forced_in, forced_out) if prune else None
    need_min = [0] * (n + 1)
    need_min[n] = bounds.none_bytes[n] - limit
    for h in range(n):
        variants = [bounds.active(m, h) for m in bounds.allowed(h, forced_in, forced_out)]
        need_min[h] = max(bounds.none_bytes[h], min(variants)) - limit
    ahead: list[float] = [0] * (n + 1)  # ahead[i] = max(need_min[i+1 ..])
    ahead[n] = -math.inf  # nothing after the last position
    for i in range(n - 1, -1, -1):
        ahead[i] = max(ahead[i + 1], need_min[i + 1])
    knapsack = _suffix_knapsacks(bounds, costs, forced_in, forced_out) if upper is not None else []

    # The key orders assignments by (cost, number not kept, then per layer the mode's
    # TIE_DIGIT, earliest layer most significant) and is additive over layers: cost and
    # count in the high bits, then n digits of TIE_BITS, layer j at digit n-1-j.
    n1 = n + 1
    width = TIE_BITS * n
    mask = (1 << width) - 1
    keep_digit = TIE_DIGIT[KEEP]
    start_key = sum(keep_digit << (TIE_BITS * (n - 1 - j)) for j in range(n))
    states: list[tuple[int, int, int]] = [(min(0, cap[0]), 0, start_key)]
    for h in range(n):
        none_need = bounds.none_bytes[h] - limit
        next_floor, next_cap = floor[h + 1], cap[h + 1]
        next_ahead = ahead[h + 1]
        if upper is not None:
            cum_saving, cum_cost, items = knapsack[h + 1]
        shift = TIE_BITS * (n - 1 - h)
        merged: dict[tuple[int, int], int] = {}
        for mode in bounds.allowed(h, forced_in, forced_out):
            need = max(none_need, bounds.active(mode, h) - limit)
            saving = bounds.saving(mode, h)
            host_add = bounds.host(mode, h) if use_host else 0
            step = (
                0
                if mode == KEEP
                else ((costs[mode][h] * n1 + 1) << width)
                + ((TIE_DIGIT[mode] - keep_digit) << shift)
            )
            for prefix, used, key in states:
                if prefix < need:
                    continue
                prefix += saving
                key += step
                used += host_add
                if prefix < next_floor or (use_host and used > host_limit):
                    continue
                if prefix > next_cap:
                    prefix = next_cap
                if upper is not None:
                    bound = (key >> width) // n1
                    deficit = next_ahead - prefix
                    if deficit > 0:  # least cost of the savings still missing
                        k = bisect_left(cum_saving, deficit)
                        if k == len(items):
                            continue  # layers ahead cannot save that much
                        before_s, before_c = (cum_saving[k - 1], cum_cost[k - 1]) if k else (0, 0)
                        item_cost, item_saving = items[k]
                        bound += before_c + (deficit - before_s) * item_cost // item_saving
                    if bound > upper:
                        continue
                old = merged.get((prefix, used))
                if old is None or key < old:
                    merged[(prefix, used)] = key
        states = _pareto(merged, use_host)
        if not states:  # host limit, or floor[0] <= 0 guarantees a state otherwise
            return None
    key = min(states, key=itemgetter(2))[2]
    digits = key & mask
    by_digit = {d: m for m, d in TIE_DIGIT.items()}
    out = {}
    for j in range(n):
        mode = by_digit[(digits >> (TIE_BITS * (n - 1 - j))) & ((1 << TIE_BITS) - 1)]
        if mode != KEEP:
            out[j] = mode
    return out


def least_recompute_set(
    bounds: StepBounds,
    limit_bytes: int,
    cost: Sequence[int],
    *,
    forced_in: frozenset[int] = frozenset(),
    forced_out: frozenset[int] = frozenset(),
    prune: bool = True,
) -> tuple[int, ...] | None:
    """The checkpoint set (layer indices, ascending; every one fully checkpointed) of least
    total ``cost`` whose allocated step peak is at most ``limit_bytes``; None when no set
    fits. Ties: fewer layers, then the lexicographically smallest index tuple. The keep/full
    case of :func:`least_cost_modes`."""
    if bounds.modes != (KEEP, FULL):
        bounds = dataclasses.replace(bounds, modes=(KEEP, FULL), host_limit_bytes=None)
    chosen = least_cost_modes(
        bounds,
        limit_bytes,
        {FULL: cost},
        forced_in=forced_in,
        forced_out=forced_out,
        prune=prune,
    )
    return None if chosen is None else tuple(chosen)


# --------------------------------------------------------------------------- splits
def _is_prime(n: int) -> bool:
    """Miller–Rabin with the first 12 prime bases: exact below 3.3e24 (Sorenson & Webster
    2015), far beyond any batch size."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _factor(n: int, factors: dict[int, int]) -> None:
    """Prime factors of ``n`` into ``factors``: small primes by trial division, the rest by
    Pollard's rho (Brent's cycle finding), so 10**18 or a large prime takes microseconds
    where trial division up to sqrt(n) takes minutes."""
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
            continue
        c = 1
        while True:
            x = y = 2
            d = 1
            while d == 1:
                x = (x * x + c) % m
                y = (y * y + c) % m
                y = (y * y + c) % m
                d = math.gcd(abs(x - y), m)
            if d != m:
                stack += [d, m // d]
                break
            c += 1


def _divisors(value: int) -> list[int]:
    """Every divisor of ``value``, ascending, from its prime factorisation."""
    factors: dict[int, int] = {}
    _factor(value, factors)
    divisors = [1]
    for prime, power in factors.items():
        divisors = [d * prime**k for d in divisors for k in range(power + 1)]
    return sorted(divisors)


def _micro_batches(target: int, world: int, lo: int, hi: int | None) -> list[int]:
    if target % world:
        return []
    per_rank = target // world
    top = per_rank if hi is None else min(hi, per_rank)
    return [b for b in _divisors(per_rank) if lo <= b <= top]


def _nearest_valid_targets(target: int, world: int, lo: int, hi: int | None) -> list[int]:
    """The nearest target batches below and above ``target`` that can be split."""
    found = []
    t = (target - 1) // world * world
    while t >= world * lo:  # a multiple of world × lo is always valid, so this ends soon
        if _micro_batches(t, world, lo, hi):
            found.append(t)
            break
        t -= world
    t = (target // world + 1) * world
    while True:
        if _micro_batches(t, world, lo, hi):
            found.append(t)
            break
        t += world
    return found


def _split_error(
    target: int, world: int, lo: int, hi: int | None, why: str, extra_hint: str = ""
) -> BadInputError:
    span = f"in [{lo}, {hi}]" if hi is not None else f"of at least {lo}"
    if hi is not None and hi < lo:
        nearest = f"none: no micro-batch is {span}"
    else:
        nearest = " or ".join(str(t) for t in _nearest_valid_targets(target, world, lo, hi))
    return BadInputError(
        f"target_batch {target} cannot be split into micro-batch × accumulation × "
        f"{world} rank(s) with a micro-batch {span}: {why}.",
        hint=f"Nearest valid target batches: {nearest}.{extra_hint}",
    )


def _has_batchnorm(profile: Profile) -> bool:
    return profile.has_batchnorm or any(layer.has_batchnorm for layer in profile.layers)


# --------------------------------------------------------------------------- modes
def _resolve_modes(
    profile: Profile, request: SolveRequest, forced_in: frozenset[int]
) -> tuple[tuple[str, ...], float]:
    """The modes this solve may use and the host link's bytes per second (for offload).
    Default: keep and full always, selective when the probe measured it, offload when
    planning for CUDA with a known host link. Asked-for modes the profile or device cannot
    do are an error that says why."""
    cuda = memory.plans_for_cuda(profile, request.device_spec)
    link, link_source = timing.host_link_bandwidth(request.device_spec)
    can = {KEEP: "", FULL: ""}
    why_not = {}
    if memory.has_selective(profile):
        can[SELECTIVE] = ""
    else:
        why_not[SELECTIVE] = (
            "the profile has no measurement of it (probed by an older memplan, or on meta)"
        )
    if not cuda:
        why_not[OFFLOAD] = "offload moves saved tensors to pinned host memory: CUDA only"
    elif link <= 0:
        why_not[OFFLOAD] = f"no host-link bandwidth to time it ({link_source})"
    else:
        can[OFFLOAD] = ""
    if request.modes is None:
        modes = tuple(m for m in MODES if m in can)
    else:
        bad = [m for m in request.modes if m not in can]
        if bad:
            raise BadInputError(
                f"--modes asks for {', '.join(bad)}, which this plan cannot use: "
                + "; ".join(f"{m}: {why_not[m]}" for m in bad)
                + ".",
                hint=f"Leave {', '.join(bad)} out of --modes"
                + (
                    ", or probe again with this memplan (on cpu or cuda)"
                    if SELECTIVE in bad
                    else ""
                )
                + (", or plan for a GPU (--device-profile NAME)" if OFFLOAD in bad else "")
                + ".",
            )
        modes = request.modes
    if forced_in and modes == (KEEP,):
        raise BadInputError(
            "always_checkpoint names layers, but --modes allows keep only.",
            hint="Add a checkpoint mode to --modes (e.g. keep,full).",
        )
    return modes, link


# --------------------------------------------------------------------------- names
def _resolve_layers(profile: Profile, names: Iterable[str], field: str) -> frozenset[int]:
    index = {name: i for i, name in enumerate(profile.layer_names)}
    chosen, unknown = set(), []
    for name in names:
        if name in index:
            chosen.add(index[name])
        elif any(ch in name for ch in "*?[") and (hits := fnmatch.filter(index, name)):
            chosen.update(index[hit] for hit in hits)
        else:
            unknown.append(name)
    if unknown:
        valid = list(profile.layer_names)
        shown = ", ".join(valid[:20]) + (f", … ({len(valid)} in all)" if len(valid) > 20 else "")
        close = sorted({m for u in unknown for m in difflib.get_close_matches(u, valid, n=3)})
        maybe = f" Did you mean {', '.join(close)}?" if close else ""
        raise BadInputError(
            f"{field} names unknown layer(s): {', '.join(map(repr, unknown))}.",
            hint=f"Valid layer names: {shown or '(the profile has no checkpoint candidates)'}."
            f"{maybe}",
        )
    return frozenset(chosen)


def _names(profile: Profile, indices: Iterable[int]) -> tuple[str, ...]:
    names = profile.layer_names
    return tuple(names[i] for i in sorted(indices))


def _short_list(names: Sequence[str]) -> str:
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]}, …, {names[-1]}"


# --------------------------------------------------------------------------- evaluation
@dataclass(frozen=True, kw_only=True, slots=True)
class _Option:
    """The best plan at one micro-batch and strategy (or, when none fits, the least peak)."""

    strategy: str
    micro_batch: int
    accumulation_steps: int
    allowed: bool
    fits: bool
    checkpointed: dict[int, str]
    """Layer index -> mode, for the layers not kept."""
    peak: Peak
    times: MicroStepTimes
    step_seconds: float
    """Communication included."""
    step_picoseconds: int
    comm_seconds: float
    comm_bytes: float
    grad_sync: GradSync = "last_micro_step"

    @property
    def rank(self) -> tuple[int, int, int, int, int]:
        return (
            self.step_picoseconds,
            STRATEGIES.index(self.strategy),
            len(self.checkpointed),
            -self.micro_batch,
            GRAD_SYNCS.index(self.grad_sync),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Context:
    profile: Profile
    request: SolveRequest
    forced_in: frozenset[int]
    forced_out: frozenset[int]
    reserve: Reserve
    limit_bytes: int
    """Largest allocated peak that fits (budget less margin and reserve)."""
    usable_bytes: int
    timing_source: timing.TimingSource
    bandwidth: float = timing.DEFAULT_INTERCONNECT_BYTES_PER_SECOND
    """Interconnect bytes per second for the communication time."""
    bandwidth_source: str = ""
    strategies: tuple[str, ...] = ("ddp",)
    modes: tuple[str, ...] = (KEEP, FULL)
    """Modes a layer may take in this solve."""
    host_link: float = 0.0
    """Host link bytes per second, for offload times (0: no offload)."""


def _sharding(ctx: _Context, strategy: str, grad_sync: GradSync = "last_micro_step") -> Sharding:
    return Sharding(strategy=strategy, world_size=ctx.request.world_size, grad_sync=grad_sync)


def _grad_syncs(strategy: str, accumulation: int, world: int) -> tuple[GradSync, ...]:
    """The ways a step may synchronise gradients: both for FSDP with accumulation."""
    if strategy == "fsdp" and accumulation > 1 and world > 1:
        return GRAD_SYNCS
    return ("last_micro_step",)


def _evaluate(
    ctx: _Context,
    micro_batch: int,
    accumulation: int,
    allowed: bool,
    strategy: str = "ddp",
    grad_sync: GradSync = "last_micro_step",
) -> _Option:
    profile = ctx.profile
    sharding = _sharding(ctx, strategy, grad_sync)
    bounds = memory.step_bounds(
        profile,
        micro_batch,
        accumulation,
        sharding,
        modes=ctx.modes,
        host_limit_bytes=ctx.request.host_memory_bytes,
    )
    times = timing.micro_step_times(
        profile, micro_batch, source=ctx.timing_source, device_spec=ctx.request.device_spec
    )
    if OFFLOAD in ctx.modes:
        times = timing.with_offload(times, timing.offload_seconds(bounds.host_bytes, ctx.host_link))
    n = len(times.fwd_seconds)
    costs = {
        mode: [timing.to_picoseconds(times.mode_seconds(i, mode)) for i in range(n)]
        for mode in ctx.modes
        if mode != KEEP
    }
    forced = {"forced_in": ctx.forced_in, "forced_out": ctx.forced_out}
    chosen = least_cost_modes(bounds, ctx.limit_bytes, costs, **forced)
    fits = chosen is not None
    if chosen is None:
        least = memory.min_allocated_bytes(bounds, **forced)
        chosen = least_cost_modes(bounds, least, costs, **forced)
        if chosen is None:  # the host limit binds there: the least peak within it
            chosen = least_cost_modes(
                dataclasses.replace(bounds, host_limit_bytes=None), least, costs, **forced
            )
        assert chosen is not None, "the least peak is reachable by definition"
    peak = memory.step_peak(
        profile, micro_batch, chosen, accumulation, reserve=ctx.reserve, sharding=sharding
    )
    comm_bytes = timing.communication_bytes(
        strategy,
        ctx.request.world_size,
        params_bytes=memory.params_bytes(profile) - profile.totals.buffer_bytes,
        grads_bytes=memory.master_bytes(profile, sharding, memory.grads_bytes(profile)),
        accumulation_steps=accumulation,
        reduce_every_micro_step=memory.syncs_every_micro_step(sharding, accumulation),
    )
    comm = timing.communication_seconds(comm_bytes, ctx.bandwidth)
    return _Option(
        strategy=strategy,
        micro_batch=micro_batch,
        accumulation_steps=accumulation,
        allowed=allowed,
        fits=fits,
        checkpointed=chosen,
        peak=peak,
        times=times,
        step_seconds=timing.step_seconds(times, accumulation, chosen) + comm,
        step_picoseconds=timing.step_picoseconds(times, accumulation, chosen)
        + timing.to_picoseconds(comm),
        comm_seconds=comm,
        comm_bytes=comm_bytes,
        grad_sync=grad_sync,
    )


def _model_ref(profile: Profile, request: SolveRequest) -> str:
    if request.model_path:
        return request.model_path
    return profile.model.spec


def _device_label(profile: Profile, request: SolveRequest) -> str:
    if request.device:
        return request.device
    if request.device_spec is not None:
        return request.device_spec.name
    env = profile.environment
    if env.device == "meta" and env.device_profile:
        return env.device_profile
    return env.device


def _plan(ctx: _Context, option: _Option, reasons: Sequence[str], warnings: Sequence[str]) -> Plan:
    profile, request = ctx.profile, ctx.request
    return Plan(
        target_batch=request.target_batch,
        micro_batch_size=option.micro_batch,
        accumulation_steps=option.accumulation_steps,
        world_size=request.world_size,
        strategy=option.strategy,
        checkpoint={
            profile.layer_names[i]: mode for i, mode in sorted(option.checkpointed.items())
        },
        shard_units=profile.layer_names if option.strategy == "fsdp" else (),
        shard_unit_types=tuple(dict.fromkeys(layer.module_type for layer in profile.layers))
        if option.strategy == "fsdp"
        else (),
        precision=profile.environment.precision,
        mixed_precision=profile.environment.mixed_precision,
        grad_sync=option.grad_sync,
        device=_device_label(profile, request),
        budget_bytes=request.budget_bytes,
        margin=request.margin,
        predicted=Prediction(
            peak_bytes=option.peak.peak_bytes,
            step_seconds=option.step_seconds,
            breakdown=option.peak.breakdown,
            peak_phase=option.peak.where,
        ),
        model=_model_ref(profile, request),
        model_fingerprint=ModelFingerprint(
            # as the model file builds them: fp32 masters when the probe cast to bf16
            parameter_bytes=memory.master_bytes(
                profile,
                _sharding(ctx, option.strategy),
                profile.totals.params_trainable_bytes + profile.totals.params_frozen_bytes,
            ),
            candidate_layers=profile.layer_names,
        ),
        profile=request.profile_path,
        reasons=tuple(reasons),
        warnings=tuple(warnings),
    )


# --------------------------------------------------------------------------- solve
def _strategies(profile: Profile, request: SolveRequest) -> tuple[str, ...]:
    """The strategies to try. Low precision under sharding runs the engine's mixed-precision
    policy (FSDP2 ``MixedPrecisionPolicy``), which a profile measures only when probed with
    parameters in the compute dtype (``--mixed-precision params``); autocast over fp32
    parameters is what single devices and DDP run."""
    env = profile.environment
    world = request.world_size
    if env.mixed_precision == "params":
        single = world == 1 and request.strategy == "auto"
        if request.strategy not in ("fsdp", "auto") or single:
            raise BadInputError(
                f"The profile was probed with {env.precision} parameters (--mixed-precision "
                f"params), which is how FSDP's mixed-precision policy runs; strategy "
                f"{request.strategy if world > 1 else 'ddp'} on {world} rank(s) runs autocast "
                "over fp32 parameters instead.",
                hint=f"Solve with --strategy fsdp, or probe again with --precision "
                f"{env.precision} (autocast) for single-device and DDP plans.",
            )
        if world == 1:
            raise BadInputError(
                "FSDP's mixed-precision policy shards over ranks; this profile (probed with "
                "--mixed-precision params) plans --world-size 2 or more.",
                hint=f"Solve with --world-size N --strategy fsdp, or probe again with "
                f"--precision {env.precision} (autocast) for one device.",
            )
        return ("fsdp",)
    if request.strategy != "auto":
        if request.strategy == "fsdp" and env.precision != "fp32":
            raise BadInputError(
                f"The profile was probed under {env.precision} autocast over fp32 parameters; "
                "FSDP trains in low precision with its mixed-precision policy instead (bf16 "
                "parameters gathered one unit at a time, bf16 activations, fp32 master shards), "
                "whose memory that profile does not measure.",
                hint=f"Probe again with --precision {env.precision} --mixed-precision params "
                "and solve that profile with --strategy fsdp.",
            )
        return (request.strategy,)
    if world == 1:
        return ("ddp",)
    if env.precision != "fp32":  # FSDP needs a profile probed with --mixed-precision params
        return tuple(st for st in STRATEGIES if st != "fsdp")
    return STRATEGIES


@dataclass(frozen=True, kw_only=True, slots=True)
class _Setup:
    """What ``solve`` and ``least_peak`` share: the context and every option evaluated."""

    ctx: _Context
    options: tuple[_Option, ...]
    bn_floor: int | None
    source_reason: str


def _setup(profile: Profile, request: SolveRequest, *, limit_bytes: int | None = None) -> _Setup:
    """Validate ``request`` against ``profile`` and evaluate every (strategy, micro-batch)
    option against the allocated limit of the request's budget, or ``limit_bytes``."""
    forced_in = _resolve_layers(profile, request.always_checkpoint, "always_checkpoint")
    forced_out = _resolve_layers(profile, request.never_checkpoint, "never_checkpoint")
    if forced_in & forced_out:
        raise BadInputError(
            "always_checkpoint and never_checkpoint both match "
            f"{', '.join(_names(profile, forced_in & forced_out))}.",
            hint="Name each layer in one of them only.",
        )

    target, world = request.target_batch, request.world_size
    lo, hi = request.min_micro, request.max_micro
    if target % world:
        raise _split_error(
            target, world, lo, hi, f"{target} is not a multiple of world_size {world}"
        )
    micro_batches = _micro_batches(target, world, lo, hi)
    if not micro_batches:
        raise _split_error(
            target, world, lo, hi, f"no micro-batch in that range divides {target // world}"
        )
    bn_floor = None
    if _has_batchnorm(profile) and not request.allow_small_bn_micro:
        bn_floor = request.bn_min_micro
        if not any(b >= bn_floor for b in micro_batches):
            raise _split_error(
                target,
                world,
                max(lo, bn_floor),
                hi,
                f"the model has BatchNorm and every possible micro-batch "
                f"({', '.join(map(str, micro_batches))}) is below bn_min_micro {bn_floor}",
                extra_hint=" Or allow small micro-batches (--allow-small-bn-micro) or lower "
                "--bn-min-micro, knowing BatchNorm statistics get noisier.",
            )

    reserve = memory.reserve_for(profile, request.device_spec)
    source, source_reason = timing.choose_timing_source(
        profile, request.device_spec, request.timing
    )
    bandwidth, bandwidth_source = timing.interconnect_bandwidth(request.device_spec)
    strategies = _strategies(profile, request)
    modes, host_link = _resolve_modes(profile, request, forced_in)
    ctx = _Context(
        modes=modes,
        host_link=host_link,
        profile=profile,
        request=request,
        forced_in=forced_in,
        forced_out=forced_out,
        reserve=reserve,
        limit_bytes=memory.allocated_limit_bytes(request.budget_bytes, request.margin, reserve)
        if limit_bytes is None
        else limit_bytes,
        usable_bytes=memory.usable_budget_bytes(request.budget_bytes, request.margin),
        timing_source=source,
        bandwidth=bandwidth,
        bandwidth_source=bandwidth_source,
        strategies=strategies,
    )
    per_rank = target // world
    options = tuple(
        option
        for st in strategies
        for option in _evaluate_micro_batches(ctx, micro_batches, per_rank, bn_floor, st)
    )
    return _Setup(ctx=ctx, options=options, bn_floor=bn_floor, source_reason=source_reason)


def solve(profile: Profile, request: SolveRequest) -> SolveResult:
    """Choose micro-batch, accumulation and checkpoint set for ``request``.

    Raises BadInputError when the target cannot be split or a layer name is unknown, and
    NoPlanFitsError (with the least peak any plan needs and the closest plan) when no
    plan fits the budget."""
    setup = _setup(profile, request)
    ctx, options, bn_floor = setup.ctx, setup.options, setup.bn_floor
    fitting = [o for o in options if o.allowed and o.fits]
    if not fitting:
        raise _no_plan_fits(ctx, options, bn_floor)
    least_sharded = min(STRATEGIES.index(o.strategy) for o in fitting)
    best = min(
        (o for o in fitting if STRATEGIES.index(o.strategy) == least_sharded),
        key=lambda o: o.rank,
    )
    reasons = _reasons(ctx, best, options, bn_floor, setup.source_reason)
    warnings = _warnings(ctx, best)
    plan = _plan(ctx, best, reasons, warnings)
    return SolveResult(
        plan=plan,
        candidates=tuple(_candidate(ctx, o, best, bn_floor) for o in options),
        usable_budget_bytes=ctx.usable_bytes,
        reserve=ctx.reserve,
        timing_source=setup.source_reason,
    )


MANY_MICRO_BATCHES = 256
"""Above this many candidate micro-batches (a target like 897612484786617600 has 103,680
divisors) the search stops at the first one that does not fit."""


def _evaluate_micro_batches(
    ctx: _Context, micro_batches: list[int], per_rank: int, bn_floor: int | None, strategy: str
) -> list[_Option]:
    """Every candidate micro-batch of ``strategy``; for very many, ascending until the first
    that does not fit even with its best checkpoint set — a larger micro-batch with
    accumulation holds more activations, so it cannot fit either — plus ``per_rank`` itself
    (accumulation 1, whose gradients are never resident with activations)."""
    options = []
    world = ctx.request.world_size
    for b in micro_batches:
        mine = [
            _evaluate(
                ctx,
                b,
                per_rank // b,
                allowed=bn_floor is None or b >= bn_floor,
                strategy=strategy,
                grad_sync=sync,
            )
            for sync in _grad_syncs(strategy, per_rank // b, world)
        ]
        options.extend(mine)
        fits = any(option.fits for option in mine)
        if len(micro_batches) > MANY_MICRO_BATCHES and not fits and b != per_rank:
            if micro_batches[-1] == per_rank:
                last = micro_batches[-1]
                options.append(
                    _evaluate(
                        ctx,
                        last,
                        1,
                        allowed=bn_floor is None or last >= bn_floor,
                        strategy=strategy,
                    )
                )
            break
    return options


@dataclass(frozen=True, kw_only=True, slots=True)
class LeastPeak:
    """The least per-rank peak any plan for a target batch needs, whatever the budget."""

    peak_bytes: int
    """Predicted peak of ``plan`` (allocated bytes plus the reserve)."""
    plan: Plan
    """A plan of least peak (ties broken in the solver's order: fastest, fewest checkpoints)."""


def least_peak(profile: Profile, request: SolveRequest) -> LeastPeak:
    """The least peak any allowed plan for ``request``'s target batch, world size and
    strategies needs; ``request.budget_bytes`` is not consulted. Each option's peak is the
    least its checkpoint sets reach (``memory.min_allocated_bytes``): the number a
    ``NoPlanFitsError`` reports. Raises BadInputError when the target cannot be split."""
    setup = _setup(profile, request, limit_bytes=-1)  # nothing fits: each option at its least
    allowed = [o for o in setup.options if o.allowed]
    closest = min(allowed, key=lambda o: (o.peak.peak_bytes, o.rank))
    plan = _plan(setup.ctx, closest, (), _warnings(setup.ctx, closest))
    return LeastPeak(peak_bytes=closest.peak.peak_bytes, plan=plan)


# --------------------------------------------------------------------------- explaining
def _over_by(ctx: _Context, option: _Option) -> str:
    return (
        f"micro-batch {option.micro_batch} would need {format_bytes(option.peak.peak_bytes)}: "
        f"over budget by {format_bytes(option.peak.peak_bytes - ctx.usable_bytes)}"
    )


def _candidate(
    ctx: _Context, option: _Option, best: _Option | None, bn_floor: int | None
) -> Candidate:
    target = ctx.request.target_batch
    chosen = best is not None and option is best
    notes = []
    # Short: the table beside it already shows peak, time and relative speed.
    if chosen:
        notes.append("chosen")
    elif not option.fits:
        notes.append(f"over budget by {format_bytes(option.peak.peak_bytes - ctx.usable_bytes)}")
    elif option.allowed and best is not None:
        slower = option.step_seconds / best.step_seconds - 1 if best.step_seconds > 0 else 0.0
        notes.append(
            f"fits; {slower:+.1%} time" if slower > 0.0005 else "fits; tie, lost on tie-break"
        )
    else:
        notes.append("fits")
    if not option.allowed:
        notes.append(f"below the BatchNorm floor of {bn_floor}")
    if option.strategy == "fsdp" and option.accumulation_steps > 1:
        notes.append(
            "reduce-scatter every micro-step"
            if option.grad_sync == "every_micro_step"
            else "reduce-scatter on the last micro-step"
        )
    return Candidate(
        micro_batch=option.micro_batch,
        accumulation_steps=option.accumulation_steps,
        feasible=option.fits and option.allowed,
        fits=option.fits,
        chosen=chosen,
        checkpoint_layers=_names(ctx.profile, option.checkpointed),
        n_checkpointed=len(option.checkpointed),
        checkpoint={
            ctx.profile.layer_names[i]: mode for i, mode in sorted(option.checkpointed.items())
        },
        peak_bytes=option.peak.peak_bytes,
        step_seconds=option.step_seconds,
        samples_per_second=target / option.step_seconds if option.step_seconds > 0 else math.inf,
        peak_phase=option.peak.where,
        note="; ".join(notes),
        strategy=option.strategy,
        grad_sync=option.grad_sync,
    )


def _breakdown_text(peak: Peak) -> str:
    b = peak.breakdown
    parts = [
        ("params", b.params),
        ("grads", b.grads),
        ("optimizer", b.optimizer),
        ("activations", b.activations),
        ("transient", b.transient),
        ("reserve", b.reserve),
    ]
    return ", ".join(f"{name} {format_bytes(value)}" for name, value in parts if value)


def _least_peak(options: Sequence[_Option], strategy: str) -> _Option | None:
    mine = [o for o in options if o.strategy == strategy and o.allowed]
    return min(mine, key=lambda o: (o.peak.peak_bytes, o.rank)) if mine else None


def _strategy_reasons(ctx: _Context, best: _Option, options: Sequence[_Option]) -> list[str]:
    """Why this strategy, and what its communication costs."""
    request = ctx.request
    world = request.world_size
    if world == 1 and best.strategy == "ddp":
        return []
    lines = []
    if request.strategy != "auto":
        lines.append(f"strategy {best.strategy}, as requested; memory figures are per rank")
    else:
        less = STRATEGIES[: STRATEGIES.index(best.strategy)]
        if not less:
            lines.append(
                "strategy ddp (auto): the least-sharded strategy, and it fits (sharding "
                "adds communication and ties every rank's state to the others')"
            )
        else:
            why = []
            for strategy in less:
                least = _least_peak(options, strategy)
                if least is not None:
                    why.append(
                        f"{strategy} needs {format_bytes(least.peak.peak_bytes)} per rank at "
                        f"the least, over the usable {format_bytes(ctx.usable_bytes)}"
                    )
            lines.append(
                f"strategy {best.strategy} (auto): the least-sharded strategy that fits; "
                + "; ".join(why)
            )
        more = STRATEGIES[STRATEGIES.index(best.strategy) + 1 :]
        faster = [
            o
            for o in options
            if o.strategy in more and o.allowed and o.fits and o.step_seconds < best.step_seconds
        ]
        if faster:
            quickest = min(faster, key=lambda o: o.rank)
            gain = 1 - quickest.step_seconds / best.step_seconds if best.step_seconds else 0.0
            if gain >= 0.01:
                lines.append(
                    f"{quickest.strategy} would be {gain:.1%} faster by the model "
                    f"({format_seconds(quickest.step_seconds)} per step: micro-batch "
                    f"{quickest.micro_batch}, {len(quickest.checkpointed)} layers checkpointed) "
                    f"at the cost of more communication and sharded state: "
                    f"--strategy {quickest.strategy}"
                )
    if best.strategy == "ddp" and world > 1:
        lines.append(
            "DDP with gradient_as_bucket_view=True: its gradient buckets are resident all "
            "step, and are the gradients once synchronised"
        )
    if best.strategy == "fsdp" and ctx.profile.environment.mixed_precision == "params":
        lines.append(
            f"FSDP mixed precision: parameters gathered and computed in "
            f"{ctx.profile.environment.precision}, fp32 master shards and optimizer state, "
            "gradients reduced in fp32 (MixedPrecisionPolicy(param_dtype, reduce_dtype=float32))"
        )
    if best.strategy == "fsdp" and best.accumulation_steps > 1:
        lines.append(_grad_sync_reason(best, options))
    if world > 1:
        lines.append(
            f"communication: {format_bytes(round(best.comm_bytes))} sent per rank per step "
            f"at {ctx.bandwidth / 1e9:g} GB/s ({ctx.bandwidth_source}): "
            f"+{format_seconds(best.comm_seconds)}, counted without overlap"
        )
    return lines


def _grad_sync_reason(best: _Option, options: Sequence[_Option]) -> str:
    """Why FSDP reduce-scatters when it does: the other way's peak and time at this size."""
    other = next(
        (
            o
            for o in options
            if o.strategy == best.strategy
            and o.micro_batch == best.micro_batch
            and o.grad_sync != best.grad_sync
        ),
        None,
    )
    if best.grad_sync == "last_micro_step":
        line = (
            "FSDP accumulates with set_requires_gradient_sync(False): gradients stay "
            "unsharded until the last micro-step (one reduce-scatter per step)"
        )
    else:
        line = (
            f"FSDP reduce-scatters every micro-step: gradients stay sharded "
            f"({best.accumulation_steps} reduce-scatters per step)"
        )
    if other is None:
        return line
    if not other.fits:
        why = f"the other way needs {format_bytes(other.peak.peak_bytes)} per rank and does not fit"
    else:
        slower = other.step_seconds / best.step_seconds - 1 if best.step_seconds > 0 else 0.0
        why = (
            f"the other way also fits ({format_bytes(other.peak.peak_bytes)} per rank) but "
            f"takes {format_seconds(other.step_seconds)} per step ({slower:+.1%})"
        )
    return f"{line}; {why}"


def _reasons(
    ctx: _Context,
    best: _Option,
    options: Sequence[_Option],
    bn_floor: int | None,
    source_reason: str,
) -> list[str]:
    profile, request = ctx.profile, ctx.request
    n = len(profile.layers)
    reasons = [
        f"effective batch {request.target_batch} = micro-batch {best.micro_batch} × "
        f"{best.accumulation_steps} accumulation step(s) × {request.world_size} rank(s)",
    ]
    reasons.extend(_strategy_reasons(ctx, best, options))
    budget_line = (
        f"budget {format_bytes(request.budget_bytes)} less {request.margin:.0%} "
        f"safety margin: predicted peaks must stay within "
        f"{format_bytes(ctx.usable_bytes)}"
    )
    if ctx.reserve.fixed_bytes or ctx.reserve.fragmentation_fraction:
        budget_line += (
            f", including {format_bytes(best.peak.reserve_bytes)} reserved for CUDA "
            f"({ctx.reserve.source})"
        )
    reasons.append(budget_line)
    throughput = request.target_batch / best.step_seconds if best.step_seconds > 0 else math.inf
    line = (
        f"micro-batch {best.micro_batch} is the fastest plan that fits: "
        f"{format_seconds(best.step_seconds)} per optimizer step, {throughput:,.1f} samples/s"
    )
    others = sorted(
        (o for o in options if o.allowed and o.fits and o is not best), key=lambda o: o.rank
    )
    if others:
        runner = others[0]
        slower = runner.step_seconds / best.step_seconds - 1 if best.step_seconds > 0 else 0.0
        other = "" if runner.strategy == best.strategy else f" with {runner.strategy}"
        line += (
            f"; next best, micro-batch {runner.micro_batch}{other}, takes "
            f"{format_seconds(runner.step_seconds)} ({slower:+.1%})"
        )
    reasons.append(line)
    too_big = [
        o
        for o in options
        if o.strategy == best.strategy
        and o.allowed
        and not o.fits
        and o.micro_batch > best.micro_batch
    ]
    reasons.extend(_over_by(ctx, o) for o in too_big[:3])
    if len(too_big) > 3:
        reasons.append(f"larger micro-batches (up to {too_big[-1].micro_batch}) need more still")

    names = _names(profile, best.checkpointed)
    if ctx.forced_in:
        reasons.append(
            f"always checkpointed, as requested: {_short_list(_names(profile, ctx.forced_in))}"
        )
    if ctx.forced_out:
        reasons.append(
            f"never checkpointed, as requested: {_short_list(_names(profile, ctx.forced_out))}"
        )
    if not names:
        reasons.append(
            f"no activation checkpointing needed: the peak of "
            f"{format_bytes(best.peak.peak_bytes)} fits without it"
        )
    else:
        recompute = timing.recompute_seconds(best.times, best.checkpointed)
        micro = timing.micro_step_seconds(best.times, best.checkpointed)
        plain = memory.step_peak(
            profile,
            best.micro_batch,
            ctx.forced_in,
            best.accumulation_steps,
            reserve=ctx.reserve,
            sharding=_sharding(ctx, best.strategy, best.grad_sync),
        )
        without = (
            ""
            if plain.peak_bytes <= ctx.usable_bytes
            else f"; without it micro-batch {best.micro_batch} would need "
            f"{format_bytes(plain.peak_bytes)}"
        )
        used = sorted(set(best.checkpointed.values()), key=MODES.index)
        what = (
            "checkpointing"
            if used == [FULL]
            else "changing the mode of ("
            + ", ".join(
                f"{sum(m == mode for m in best.checkpointed.values())} {mode}" for mode in used
            )
            + ")"
        )
        reasons.append(
            f"{what} {len(names)} of {n} layers ({_short_list(names)}): the least "
            f"extra time that fits, +{format_seconds(recompute)} per micro-step "
            f"({recompute / micro:.0%} of it){without}"
            if micro > 0
            else f"{what} {len(names)} of {n} layers ({_short_list(names)}){without}"
        )
        reasons.extend(_layer_mode_reasons(ctx, best))
    reasons.append(
        f"peak {format_bytes(best.peak.peak_bytes)} during {best.peak.where}: "
        f"{_breakdown_text(best.peak)}"
    )
    if bn_floor is not None:
        excluded = [o.micro_batch for o in options if not o.allowed]
        if excluded:
            reasons.append(
                f"micro-batches below {bn_floor} ({', '.join(map(str, excluded))}) excluded: "
                f"the model has BatchNorm, whose statistics are computed per micro-batch "
                f"(--allow-small-bn-micro allows them)"
            )
    elif _has_batchnorm(profile) and request.allow_small_bn_micro:
        reasons.append(f"BatchNorm floor of {request.bn_min_micro} waived, as requested")
    reasons.append(source_reason)
    return reasons


def _layer_mode_reasons(ctx: _Context, best: _Option) -> list[str]:
    """One line per layer not kept: its mode, what it frees and costs, and why no cheaper
    mode of that layer would do (with the other layers as they are, the plan would then
    exceed the budget or the host memory: the plan is the least-time one, so every cheaper
    swap fails). Then one line for the kept layers."""
    profile = ctx.profile
    bounds = memory.step_bounds(
        profile,
        best.micro_batch,
        best.accumulation_steps,
        _sharding(ctx, best.strategy, best.grad_sync),
        modes=ctx.modes,
        host_limit_bytes=ctx.request.host_memory_bytes,
    )
    lines = []
    for i, mode in sorted(best.checkpointed.items()):
        cost = best.times.mode_seconds(i, mode)
        text = (
            f"{profile.layer_names[i]}: {mode}, frees {format_bytes(bounds.saving(mode, i))} "
            f"while held, +{format_seconds(cost)} per micro-step"
        )
        worse = []
        for other in bounds.allowed(i, ctx.forced_in, ctx.forced_out):
            if other == mode or best.times.mode_seconds(i, other) > cost:
                continue
            swapped = {**best.checkpointed, i: other}
            swapped = {j: m for j, m in swapped.items() if m != KEEP}
            over = memory.bounds_peak_bytes(bounds, swapped) - ctx.limit_bytes
            host = ctx.request.host_memory_bytes
            if over > 0:
                worse.append(f"{other} would exceed the budget by {format_bytes(over)}")
            elif host is not None and memory.host_total_bytes(bounds, swapped) > host:
                worse.append(f"{other} would exceed --host-memory")
            else:
                worse.append(f"{other} fits at equal time (tie-break)")
        if worse:
            text += ": " + "; ".join(worse)
        elif mode == FULL and len(ctx.modes) > 2:
            text += ": no cheaper mode of this layer saves bytes"
        lines.append(text)
    kept = [name for i, name in enumerate(profile.layer_names) if i not in best.checkpointed]
    if kept and len(ctx.modes) > 2:
        lines.append(f"kept ({len(kept)}): {_short_list(kept)}: keeping costs nothing")
    modes_line = "layer modes considered: " + ", ".join(ctx.modes)
    missing = [m for m in MODES if m not in ctx.modes]
    if missing:
        modes_line += f" (not {', '.join(missing)}"
        modes_line += ": --modes)" if ctx.request.modes is not None else ")"
    lines.append(modes_line)
    return lines


def _warnings(ctx: _Context, best: _Option) -> list[str]:
    profile, request = ctx.profile, ctx.request
    b = best.micro_batch
    warnings = []
    if _has_batchnorm(profile):
        warnings.append(
            f"the model has BatchNorm: its batch statistics are computed over each micro-batch "
            f"of {b}, not the effective batch of {request.target_batch}"
        )
        bn_layers = [
            profile.layers[i].name for i in best.checkpointed if profile.layers[i].has_batchnorm
        ]
        if bn_layers:
            warnings.append(
                f"BatchNorm running statistics update twice per step in checkpointed layers "
                f"({_short_list(bn_layers)}): the recompute runs their forward again"
            )
    probed = profile.micro_batches
    largest = max(probed)
    if b > 4 * largest:
        warnings.append(
            f"micro-batch {b} is {b / largest:.0f}× the largest probed size ({largest}); the "
            f"model is validated to 4×: run `memplan verify` before relying on it"
        )
    if not min(probed) <= b <= largest:
        loose = [layer.name for layer in profile.layers if not layer.affine]
        if loose:
            warnings.append(
                f"layers {_short_list(loose)} were not affine in the batch size when probed; "
                f"micro-batch {b} is outside the probed sizes, so their bytes are extrapolated"
            )
    if not profile.op_sequence_stable:
        warnings.append(
            f"the op sequence differed between probed sizes (data-dependent routing): verify "
            f"the plan at micro-batch {b}"
        )
    capacity = (
        request.device_spec.memory_bytes
        if request.device_spec is not None
        else profile.environment.device_capacity_bytes
    )
    if capacity is not None and request.budget_bytes > capacity:
        warnings.append(
            f"the budget {format_bytes(request.budget_bytes)} exceeds the device's "
            f"{format_bytes(capacity)}"
        )
    if request.world_size > 1 and best.strategy == "zero2":
        warnings.append(
            "zero2 is modelled on DeepSpeed's documented behaviour (reduce bucket of "
            "reduce_bucket_size elements), not verified by memplan: run it under DeepSpeed "
            "and compare its memory report"
        )
    warnings.extend(f"profile: {message}" for message in _profile_warnings(profile, warnings))
    return warnings


def _profile_warnings(profile: Profile, said: Sequence[str]) -> list[str]:
    """The probe's warnings a plan repeats: not those the solver has already said in its
    own words for this plan (BatchNorm; bytes extrapolated from a non-affine layer), so
    each warning appears once."""
    bn_said = any("BatchNorm" in w for w in said)
    extrapolated = any("extrapolated" in w for w in said)
    kept = []
    for message in profile.warnings:
        if bn_said and "BatchNorm" in message:
            continue
        if extrapolated and "not affine" in message:
            continue
        kept.append(message)
    return kept


def _no_plan_fits(
    ctx: _Context, options: Sequence[_Option], bn_floor: int | None
) -> NoPlanFitsError:
    profile, request = ctx.profile, ctx.request
    allowed = [o for o in options if o.allowed]
    closest = min(allowed, key=lambda o: (o.peak.peak_bytes, o.rank))
    least = closest.peak.peak_bytes
    n = len(profile.layers)
    strategies = ", ".join(ctx.strategies)
    message = (
        f"No plan ({strategies} on {request.world_size} rank(s)) for target batch "
        f"{request.target_batch} fits "
        f"{format_bytes(request.budget_bytes)} (less {request.margin:.0%} margin: "
        f"{format_bytes(ctx.usable_bytes)}). The smallest peak any plan needs is "
        f"{format_bytes(least)} per rank: {closest.strategy}, micro-batch "
        f"{closest.micro_batch} × "
        f"{closest.accumulation_steps} accumulation step(s), {len(closest.checkpointed)} of "
        f"{n} layers checkpointed, peaking during {closest.peak.where}."
    )
    hints = []
    if request.margin > 0 and least <= request.budget_bytes:
        # Only the safety margin rules the closest plan out: say so, and how to plan anyway.
        accepted = math.floor((1.0 - least / request.budget_bytes) * 1000) / 1000
        smaller = f" (or --margin {accepted:g})" if accepted > 0 else ""
        hints.append(
            f"the budget itself holds that plan ({format_bytes(least)} <= "
            f"{format_bytes(request.budget_bytes)}): only the {request.margin:.0%} safety "
            f"margin rules it out; --margin 0{smaller} plans without it, at the risk of running "
            f"out of memory if the real peak exceeds the prediction"
        )
    hints.append(
        f"a budget of at least "
        f"{format_bytes(memory.budget_for_peak_bytes(least, request.margin), precision=2)}"
    )
    hints.extend(_smaller_micro_hints(ctx, options, bn_floor))
    hints.extend(_layers_hint(ctx, closest, least))
    state = (
        memory.params_bytes(profile)
        + memory.grads_bytes(profile)
        + memory.optimizer_state_bytes(profile)
    )
    trainable_state = memory.grads_bytes(profile) + memory.optimizer_state_bytes(profile)
    if state + closest.peak.reserve_bytes > ctx.usable_bytes and "fsdp" not in ctx.strategies:
        hints.append(
            f"the model state alone (params {format_bytes(memory.params_bytes(profile))}, "
            f"grads {format_bytes(memory.grads_bytes(profile))}, optimizer "
            f"{format_bytes(memory.optimizer_state_bytes(profile))}) exceeds the budget: shard "
            f"it across ranks (FSDP / ZeRO; more DDP ranks alone do not shrink per-rank memory)"
        )
    if profile.environment.precision == "fp32":
        hints.append(
            "lower precision (bf16 autocast roughly halves activation bytes; probe again with it)"
        )
    if trainable_state > 0:
        hints.append(
            f"training adapters only (e.g. LoRA) drops most of the "
            f"{format_bytes(trainable_state)} of gradients and optimizer state"
        )
    closest_plan = _plan(ctx, closest, [message], _warnings(ctx, closest))
    return NoPlanFitsError(
        message,
        hint="What would fit: " + "; ".join(hints) + ".",
        min_peak_bytes=least,
        closest=closest_plan,
    )


def _layers_hint(ctx: _Context, closest: _Option, least: int) -> list[str]:
    """Whether naming other checkpoint candidates (``--layers``) could help: only when the
    closest plan already checkpoints every candidate, and only as much as the activations
    the fixed parts (everything outside the candidates) keep at its micro-batch."""
    profile = ctx.profile
    n = len(profile.layers)
    if n and len(closest.checkpointed) < n:
        return []
    outside = int(sum(part.saved_bytes.at(closest.micro_batch) for part in profile.fixed))
    deficit = least - ctx.usable_bytes
    if outside >= deficit > 0:
        parts = sorted(profile.fixed, key=lambda p: -p.saved_bytes.at(closest.micro_batch))
        names = ", ".join(p.name for p in parts[:3])
        return [
            f"more checkpoint candidates (probe again with --layers GLOB naming finer or more "
            f"modules): outside the {n} candidate layer(s), {names} keep "
            f"{format_bytes(outside)} of activations at micro-batch {closest.micro_batch}"
        ]
    return [
        f"not --layers: every candidate is already checkpointed, and the activations outside "
        f"them ({format_bytes(outside)}) are less than the {format_bytes(deficit)} missing"
    ]


def _smaller_micro_hints(
    ctx: _Context, options: Sequence[_Option], bn_floor: int | None
) -> list[str]:
    """Smaller micro-batches this request excludes that would fit."""
    request = ctx.request
    hints = []
    excluded_fit = [o for o in options if not o.allowed and o.fits]
    if excluded_fit:
        best = max(excluded_fit, key=lambda o: o.micro_batch)
        hints.append(
            f"micro-batch {best.micro_batch} would fit "
            f"({format_bytes(best.peak.peak_bytes)}) but is below the BatchNorm floor "
            f"of {bn_floor} (--allow-small-bn-micro)"
        )
        return hints
    smallest = min(o.micro_batch for o in options)
    per_rank = request.target_batch // request.world_size
    least_option = min(options, key=lambda o: (o.peak.peak_bytes, o.rank))
    sharding = _sharding(ctx, least_option.strategy, least_option.grad_sync)
    # The largest smaller divisor of the per-rank batch that fits; a non-divisor only when
    # no divisor fits (and then with a target it divides, never as a --min-micro).
    divisors = [b for b in range(smallest - 1, 0, -1) if per_rank % b == 0]
    others = [b for b in range(smallest - 1, max(0, smallest - 65), -1) if per_rank % b]
    for b in divisors + others:
        accumulation = per_rank // b if per_rank % b == 0 else 2
        bounds = memory.step_bounds(ctx.profile, b, accumulation, sharding)
        if not memory.fits_somehow(
            bounds, ctx.limit_bytes, forced_in=ctx.forced_in, forced_out=ctx.forced_out
        ):
            continue
        least = memory.min_allocated_bytes(
            bounds, forced_in=ctx.forced_in, forced_out=ctx.forced_out
        )
        needs = format_bytes(least + ctx.reserve.bytes_for(least))
        if per_rank % b == 0 and b < request.min_micro:
            why = f"lower --min-micro to {b}"
        elif per_rank % b == 0 and bn_floor is not None and b < bn_floor:
            why = "allow it with --allow-small-bn-micro"
        else:
            unit = b * request.world_size
            nearest = max(unit, round(request.target_batch / unit) * unit)
            why = f"choose a target batch it divides, e.g. {nearest}"
        hints.append(f"micro-batch {b} would fit ({needs}): {why}")
        break
    return hints
