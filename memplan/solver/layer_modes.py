"""Per-layer modes under a byte budget: the exact DP over layers (keep / selective / full /
offload) that finds the least-cost assignment whose every step point fits. No torch.

The exactness argument is in memplan.solver's docstring and docs/design.md, "The solver".
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from itertools import accumulate, pairwise
from operator import itemgetter
from typing import Any

from memplan import memory
from memplan.memory import StepBounds
from memplan.modes import FULL, KEEP, TIE_BITS, TIE_DIGIT

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
) -> tuple[str, int, int] | None:
    """Layer h's mode of least cost per byte saved among ``modes`` that save bytes (ties:
    the larger saving, then MODES order), with its cost and saving."""
    best = None
    for mode in modes:
        saving = bounds.saving(mode, h) if mode != KEEP else 0
        if saving <= 0:
            continue
        cost = costs[mode][h]
        # cost/saving < best's, exactly (savings are positive), or equal and saving more
        if best is None or (
            cost * best[2] < best[1] * saving
            or (cost * best[2] == best[1] * saving and saving > best[2])
        ):
            best = (mode, cost, saving)
    return best


def _by_ratio(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``rows`` (cost, saving > 0, tie-breaks...) sorted by the exact ratio cost/saving,
    then the tie-breaks, as sorting by ``(Fraction(cost, saving), *tie-breaks)`` would.
    Sorts by the float ratio first: int division is correctly rounded, hence monotone, so
    distinct ratios that round to one float are the only ones out of order, and each run
    of equal floats holding more than one exact ratio is sorted again exactly."""
    floats = [row[0] / row[1] for row in rows]
    order = sorted(range(len(rows)), key=lambda i: (floats[i], *rows[i][2:]))
    out = [rows[i] for i in order]
    start = 0
    for end in range(1, len(out) + 1):
        if end < len(out) and floats[order[end]] == floats[order[start]]:
            continue
        if end - start > 1:
            first = out[start]
            if any(c * first[1] != first[0] * sv for c, sv, *_ in out[start + 1 : end]):
                out[start:end] = sorted(
                    out[start:end], key=lambda row: (Fraction(row[0], row[1]), *row[2:])
                )
        start = end
    return out


def _fits(bounds: StepBounds, limit: int, assignment: Mapping[int, str]) -> bool:
    if memory.bounds_peak_bytes(bounds, assignment) > limit:
        return False
    return bounds.host_limit_bytes is None or (
        memory.host_total_bytes(bounds, assignment) <= bounds.host_limit_bytes
    )


def _least_fitting_prefix(
    bounds: StepBounds, limit: int, assignment: Callable[[int], dict[int, str]], count: int
) -> dict[int, str] | None:
    """``assignment(m)`` for the smallest m in 0 .. count that fits (binary search, assuming
    more never hurts), or None when even ``assignment(count)`` does not."""
    if not _fits(bounds, limit, assignment(count)):
        return None
    lo, hi = -1, count
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(bounds, limit, assignment(mid)):
            hi = mid
        else:
            lo = mid
    return assignment(hi)


def _greedy_cost(
    bounds: StepBounds,
    limit: int,
    costs: Costs,
    forced_in: frozenset[int],
    forced_out: frozenset[int],
) -> int | None:
    """Cost of some assignment that fits, or None: the cheaper of two greedy ones, each the
    forced layers plus the shortest prefix that fits of (a) the layers by best cost per
    byte saved, each in its most efficient mode, and (b) every layer's hull steps
    (:func:`_hull_steps`) by cost per byte, each layer in the mode of its last step taken.
    Only an upper bound for pruning the DP; its quality affects speed, never the answer."""
    n = len(bounds.plain_bytes)
    free: list[tuple[int, int, int, str]] = []  # (cost, saving, layer, mode)
    steps: list[tuple[int, int, int, int, str]] = []  # (cost, saving, layer, k, mode)
    forced: dict[int, str] = {}
    for j in range(n):
        if j in forced_out:
            continue
        allowed = [m for m in bounds.allowed(j, forced_in, forced_out) if m != KEEP]
        best = _efficient_mode(bounds, costs, j, allowed)
        hull = _hull_steps(bounds, costs, j, allowed)
        if j in forced_in:
            if not allowed:
                return None
            forced[j] = best[0] if best is not None else allowed[0]
        elif best is not None:
            free.append((best[1], best[2], j, best[0]))
        steps += [(c, s, j, k, mode) for k, (c, s, mode) in enumerate(hull)]
    # by ratio, then layer (then step): the layers and modes are unique keys
    free = _by_ratio(free)
    steps = _by_ratio(steps)

    def by_layer(m: int) -> dict[int, str]:
        return {**forced, **{j: mode for _, _, j, mode in free[:m]}}

    def by_step(m: int) -> dict[int, str]:
        chosen = dict(forced)
        for _, _, j, _, mode in steps[:m]:
            chosen[j] = mode
        return chosen

    found = [
        _least_fitting_prefix(bounds, limit, by_layer, len(free)),
        _least_fitting_prefix(bounds, limit, by_step, len(steps)),
    ]
    prices = [sum(costs[mode][j] for j, mode in a.items()) for a in found if a is not None]
    return min(prices) if prices else None


def _hull_steps(
    bounds: StepBounds, costs: Costs, h: int, modes: Sequence[str]
) -> list[tuple[int, int, str]]:
    """Layer h's modes that save bytes, as the steps of the lower convex hull of its
    (saving, cost) points from (0, 0): each step (extra cost, extra saving, mode reached),
    in increasing cost per byte. A mode above the hull is never worth a fraction of it
    (the multiple-choice knapsack's LP relaxation takes hull steps only, in this order)."""
    best: dict[int, tuple[int, str]] = {}
    for mode in modes:
        saving = bounds.saving(mode, h) if mode != KEEP else 0
        if saving <= 0:
            continue
        cost = costs[mode][h]
        if saving not in best or cost < best[saving][0]:
            best[saving] = (cost, mode)
    # a point is worth something only if every point that saves more costs more
    points: list[tuple[int, int, str]] = []  # (saving, cost, mode), savings descending
    for saving in sorted(best, reverse=True):
        cost, mode = best[saving]
        if not points or cost < points[-1][1]:
            points.append((saving, cost, mode))
    hull: list[tuple[int, int, str]] = [(0, 0, KEEP)]
    for saving, cost, mode in reversed(points):
        while len(hull) >= 2:
            (s0, c0, _), (s1, c1, _) = hull[-2], hull[-1]
            # the last point stays only if it lies strictly below the chord to this one
            if (c1 - c0) * (saving - s0) < (cost - c0) * (s1 - s0):
                break
            hull.pop()
        hull.append((saving, cost, mode))
    return [(c1 - c0, s1 - s0, mode) for (s0, c0, _), (s1, c1, mode) in pairwise(hull)]


def _suffix_knapsacks(
    bounds: StepBounds, costs: Costs, forced_in: frozenset[int], forced_out: frozenset[int]
) -> list[tuple[list[int], list[int], list[tuple[int, int]]]]:
    """For each layer i: the hull steps (:func:`_hull_steps`) of the layers i .. n-1, by
    increasing cost per byte, with running sums of savings and costs. The least cost of
    saving D bytes with a fraction of a step allowed (the LP relaxation of choosing one
    mode per layer, read off these sums) is a lower bound on the real least cost.

    Each list is as long as the steps ahead, so for many layers the lists are kept at
    every ``stride``-th layer (and the last ``stride``) only, and a layer in between reads
    the one kept before it: the steps of a few more layers, so a bound that is lower, still
    a bound (pruning a little less, the same answer) in memory linear in the layers."""
    n = len(bounds.plain_bytes)
    stride = max(1, n // _KNAPSACKS_KEPT)
    out: list = [([], [], [])] * (n + 1)
    hulls = [
        _hull_steps(
            bounds, costs, i, [m for m in bounds.allowed(i, forced_in, forced_out) if m != KEEP]
        )
        if i not in forced_out
        else []
        for i in range(n)
    ]
    # each step's ratio as its rank among all steps' ratios (equal ratios, equal ranks)
    ranked = _by_ratio(
        [(c, sv, i, k) for i, hull in enumerate(hulls) for k, (c, sv, _) in enumerate(hull)]
    )
    rank: dict[tuple[int, int], int] = {}
    r = -1
    for at, (c, sv, i, k) in enumerate(ranked):
        if not at or c * ranked[at - 1][1] != ranked[at - 1][0] * sv:
            r += 1
        rank[(i, k)] = r
    ratios: list[int] = []
    items: list[tuple[int, int]] = []
    for i in range(n - 1, -1, -1):
        for k, (step_cost, step_saving, _) in enumerate(hulls[i]):
            at = bisect_right(ratios, rank[(i, k)])
            ratios.insert(at, rank[(i, k)])
            items.insert(at, (step_cost, step_saving))
        if not hulls[i] and out[i + 1] is not None:
            out[i] = out[i + 1]  # the same steps
        elif i % stride == 0 or i >= n - stride:
            out[i] = (
                list(accumulate(map(itemgetter(1), items))),
                list(accumulate(map(itemgetter(0), items))),
                list(items),
            )
        else:
            out[i] = None
    for i in range(1, n):
        if out[i] is None:
            out[i] = out[i - 1]
    return out


_KNAPSACKS_KEPT = 256
"""Above this many layers :func:`_suffix_knapsacks` keeps about this many lists."""


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
    if (
        not forced_in
        and KEEP in bounds.modes
        and memory.bounds_peak_bytes(bounds, {}) <= limit_bytes
    ):
        # Keeping every layer fits: cost 0 and no layer not kept, the least key there is
        # (keep takes no host memory). One walk instead of the DP.
        return {}
    floor = memory.feasible_floor_bytes(
        bounds, limit_bytes, forced_in=forced_in, forced_out=forced_out
    )
    if floor[0] > 0:
        return None
    n = len(bounds.savings)
    limit = limit_bytes
    cap = _cap_bytes(bounds, limit, forced_in, forced_out)

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
    allowed = [bounds.allowed(h, forced_in, forced_out) for h in range(n)]
    dp = _Dp(bounds, limit, costs, allowed, floor, cap, ahead)
    if upper is None:
        return dp.run(None)
    dp.knapsack = _suffix_knapsacks(bounds, costs, forced_in, forced_out)
    # Tighten the bound: the DP under a bound U at least the optimum's cost returns the
    # optimum (every state of its path, or one that dominates it, stays within U), and
    # None under a U below it. The fractional knapsack from the start is a lower bound,
    # usually within a fraction of a percent of the optimum, the greedy plan's cost a few
    # percent above it; a U close to the optimum prunes far more. The last try is the
    # greedy cost itself, so the answer is the one the plain bounded DP gives.
    # A run that finds nothing also says how far: the least bound among the states it
    # pruned is a lower bound on the optimum (the optimum's path, or a state dominating
    # it, was pruned somewhere with a bound at most its cost), so the next try starts
    # there at least (on identical layers the first such bound is the optimum itself).
    lower = min(_knapsack_bound(dp.knapsack[0], ahead[0]), upper)
    tried = lower - 1
    for shift in _TIGHTEN_SHIFTS:
        bound = max(lower, tried + 1, lower + ((upper - lower) >> shift))
        if bound >= upper:
            break
        found = dp.run(bound)
        if found is not None:
            return found
        tried, lower = bound, max(lower, dp.pruned_least)
    return dp.run(upper)


_TIGHTEN_SHIFTS = tuple(range(12, 0, -1))
"""Bounds tried before the greedy cost: the lower bound plus 2^-shift of the gap, or more
(the lower bound rises as runs fail)."""


def _knapsack_bound(
    knapsack: tuple[list[int], list[int], list[tuple[int, int]]], deficit: float
) -> int:
    """The least cost of saving ``deficit`` more bytes with a fraction of a step allowed
    (rounded down), read off a :func:`_suffix_knapsacks` entry; huge when it cannot."""
    if deficit <= 0:
        return 0
    cum_saving, cum_cost, items = knapsack
    k = bisect_left(cum_saving, deficit)
    if k == len(items):
        return _UNREACHABLE
    before_s, before_c = (cum_saving[k - 1], cum_cost[k - 1]) if k else (0, 0)
    item_cost, item_saving = items[k]
    return before_c + int((deficit - before_s) * item_cost // item_saving)


_UNREACHABLE = 1 << 200


class _Dp:
    """The DP over layers for one request, run under a cost bound (or none)."""

    def __init__(
        self,
        bounds: StepBounds,
        limit: int,
        costs: Costs,
        allowed: list[tuple[str, ...]],
        floor: list[int],
        cap: list[int],
        ahead: list[float],
    ) -> None:
        self.bounds, self.limit, self.costs, self.allowed = bounds, limit, costs, allowed
        self.floor, self.cap, self.ahead = floor, cap, ahead
        self.knapsack: list[tuple[list[int], list[int], list[tuple[int, int]]]] = []
        self.pruned_least = _UNREACHABLE

    def run(self, upper: int | None) -> dict[int, str] | None:
        """The least-key assignment whose cost is at most ``upper`` (None: any), or None;
        ``pruned_least`` is then the least bound among the states it pruned (a lower bound
        on the cost of any assignment that fits; ``_UNREACHABLE`` if it pruned none)."""
        self.pruned_least = pruned_least = _UNREACHABLE
        bounds, limit, costs = self.bounds, self.limit, self.costs
        floor, cap, ahead, knapsack = self.floor, self.cap, self.ahead, self.knapsack
        n = len(bounds.savings)
        host_limit = bounds.host_limit_bytes if bounds.host_binding else None
        use_host = host_limit is not None

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
            for mode in self.allowed[h]:
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
                            before_s, before_c = (
                                (cum_saving[k - 1], cum_cost[k - 1]) if k else (0, 0)
                            )
                            item_cost, item_saving = items[k]
                            bound += before_c + (deficit - before_s) * item_cost // item_saving
                        if bound > upper:
                            if bound < pruned_least:
                                pruned_least = bound
                            continue
                    old = merged.get((prefix, used))
                    if old is None or key < old:
                        merged[(prefix, used)] = key
            states = _pareto(merged, use_host)
            if not states:  # host limit, or floor[0] <= 0 guarantees a state otherwise
                self.pruned_least = pruned_least
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
