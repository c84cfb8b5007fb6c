"""Splitting a target batch: the divisors of target / world that can be micro-batches, and the
error naming the nearest targets that split when none does. No torch.
"""

from __future__ import annotations

import math

from memplan.errors import BadInputError


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


def divisors(value: int) -> list[int]:
    """Every divisor of ``value``, ascending, from its prime factorisation."""
    factors: dict[int, int] = {}
    _factor(value, factors)
    divisors = [1]
    for prime, power in factors.items():
        divisors = [d * prime**k for d in divisors for k in range(power + 1)]
    return sorted(divisors)


def micro_batch_sizes(target: int, world: int, lo: int, hi: int | None) -> list[int]:
    if target % world:
        return []
    per_rank = target // world
    top = per_rank if hi is None else min(hi, per_rank)
    return [b for b in divisors(per_rank) if lo <= b <= top]


_NEAREST_STEPS = 1000
"""Targets ``_nearest_valid_targets`` tries each way, one world size apart, before it falls
back to the multiples of world × the smallest micro-batch."""


def _nearest_valid_targets(target: int, world: int, lo: int, hi: int | None) -> list[int]:
    """The nearest target batches below and above ``target`` that can be split (``lo <= hi``).
    Tried one world size apart, up to ``_NEAREST_STEPS`` each way; past that, the nearest
    multiples of ``world × lo``, which always split (micro-batch ``lo``), so the search ends
    on any input (a ``--min-micro`` of 10**18 once stepped through every target below it)."""
    unit = world * lo
    found = []
    t = (target - 1) // world * world
    for _ in range(_NEAREST_STEPS):
        if t < unit or micro_batch_sizes(t, world, lo, hi):
            break
        t -= world
    else:
        t = (target - 1) // unit * unit
    if t >= unit:
        found.append(t)
    t = max((target // world + 1) * world, unit)  # below unit, no micro-batch is >= lo
    for _ in range(_NEAREST_STEPS):
        if micro_batch_sizes(t, world, lo, hi):
            break
        t += world
    else:
        t = (target // unit + 1) * unit
    found.append(t)
    return found


class SplitError(BadInputError):
    """The target batch has no split into micro-batch × accumulation × ranks within the
    micro-batch bounds (exit 2). A length search takes it as "no plan at this length":
    a longer sequence leaves fewer samples of a batch in tokens to split."""


def split_error(
    target: int, world: int, lo: int, hi: int | None, why: str, extra_hint: str = ""
) -> SplitError:
    span = f"in [{lo}, {hi}]" if hi is not None else f"of at least {lo}"
    if hi is not None and hi < lo:
        nearest = f"none: no micro-batch is {span}"
    else:
        nearest = " or ".join(str(t) for t in _nearest_valid_targets(target, world, lo, hi))
    return SplitError(
        f"target_batch {target} cannot be split into micro-batch × accumulation × "
        f"{world} rank(s) with a micro-batch {span}: {why}.",
        hint=f"Nearest valid target batches: {nearest}.{extra_hint}",
    )
