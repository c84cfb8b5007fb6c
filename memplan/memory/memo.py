"""Memory of what depends only on a frozen object (a profile, a phase's segments) and a few
hashable arguments (a ``Sharding``, a phase, a count of micro-steps), but is asked again
for every segment of every micro-batch a solve tries: the layout search asks a 126-block
model's per-rank terms hundreds of thousands of times. No torch.

Keyed by the object's identity, as ``memplan.profile.arrays`` and the rank adjustments are
(hashing a profile, or 256 segments, would cost what the lookup saves): the entry holds the
object itself, so its id cannot be reused by another object while the entry lives.
Bounded: the oldest entries go first."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


def by_identity(size: int) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Remember ``fn(obj, *args, **kwargs)`` for the ``size`` latest calls, ``obj`` by
    identity, the rest by value (hashable; a keyword and its position are two entries of
    one value). The wrapped function's ``cache_clear()`` empties it."""

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        cache: OrderedDict[tuple, tuple[object, R]] = OrderedDict()

        @functools.wraps(fn)
        def remembered(obj: object, *args: object, **kwargs: object) -> R:
            key = (id(obj), *args, *sorted(kwargs.items()))
            hit = cache.get(key)
            if hit is not None and hit[0] is obj:
                return hit[1]
            value = fn(obj, *args, **kwargs)
            cache[key] = (obj, value)
            if len(cache) > size:
                cache.popitem(last=False)
            return value

        remembered.cache_clear = cache.clear  # type: ignore[attr-defined]
        return remembered

    return wrap
