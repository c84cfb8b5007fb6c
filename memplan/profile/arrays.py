"""Per-layer affine quantities of a profile at one micro-batch, as float64 arrays: what the
solver asks of every layer at each micro-batch it tries (a profile of 10,000 layers has
140,000 affines). No torch.

Exact, not an approximation: ``intercept + slope * b`` in float64 is the same two IEEE
operations ``Affine.at`` does (numpy does not fuse them), and the callers round with the
same functions. Anything these arrays cannot give exactly (an optional quantity a layer
lacks, a micro-batch over 2^53, a value that is not finite or too large for int64) answers
None, and the caller takes its one-layer-at-a-time path, with its errors.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from memplan.profile import Profile

_EXACT_INT = 1 << 53
"""Micro-batches up to this convert to float64 exactly (as Python's ``s * b`` does)."""
_INT64_SAFE = float(1 << 62)
"""Rounded values below this in magnitude convert to int64, and back, exactly."""

_cache: OrderedDict[tuple[int, str], tuple[Profile, object]] = OrderedDict()
_CACHE_SIZE = 64


def _coefficients(profile: Profile, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Every layer's ``name`` (an Affine field) as (intercepts, slopes), cached per profile;
    None when some layer has none."""
    key = (id(profile), name)
    hit = _cache.get(key)
    if hit is not None and hit[0] is profile:
        _cache.move_to_end(key)
        return hit[1]  # type: ignore[return-value]
    values = [getattr(layer, name) for layer in profile.layers]
    arrays = None
    if all(value is not None for value in values):
        arrays = (
            np.fromiter((v.intercept for v in values), dtype=np.float64, count=len(values)),
            np.fromiter((v.slope for v in values), dtype=np.float64, count=len(values)),
        )
    _cache[key] = (profile, arrays)
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return arrays


def layer_values(profile: Profile, name: str, micro_batch: int) -> np.ndarray | None:
    """``layer.<name>.at(micro_batch)`` for every layer, or None (see the module doc)."""
    if abs(micro_batch) > _EXACT_INT:
        return None
    arrays = _coefficients(profile, name)
    if arrays is None:
        return None
    intercepts, slopes = arrays
    with np.errstate(all="ignore"):
        values = intercepts + slopes * np.float64(micro_batch)
    return values if np.isfinite(values).all() else None


def layer_ints(profile: Profile, name: str) -> np.ndarray:
    """Every layer's integer field ``name`` as float64, as Python turns an int into a float
    when adding it to one (correctly rounded), cached per profile."""
    key = (id(profile), name)
    hit = _cache.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]  # type: ignore[return-value]
    array = np.array([float(getattr(layer, name)) for layer in profile.layers], dtype=np.float64)
    _cache[key] = (profile, array)
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return array


def rounded_ints(values: np.ndarray | None, rounding: str) -> tuple[int, ...] | None:
    """``math.floor`` / ``math.ceil`` / ``round`` of each value (``rounding``: floor, ceil,
    rint) as Python ints, or None when ``values`` is None or one is too large for int64."""
    if values is None:
        return None
    rounded = {"floor": np.floor, "ceil": np.ceil, "rint": np.rint}[rounding](values)
    if rounded.size and not float(np.abs(rounded).max()) < _INT64_SAFE:
        return None
    return tuple(rounded.astype(np.int64).tolist())
