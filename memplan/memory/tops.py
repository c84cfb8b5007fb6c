"""Every segment's highest point at one micro-batch, at once: ``segment_points_bytes`` for a
whole phase's timeline in a few array operations instead of one Python call per segment
(the solver asks for them at each micro-batch; a profile of 10,000 layers has 40,000
segments). No torch.

Exact, not an approximation: each point is ``a + s * b`` in float64, the same two IEEE
operations Python's floats do (numpy does not fuse them), the maximum is taken per segment,
and ``math.ceil`` rounds it to a Python int as ``segment_points_bytes`` does.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from memplan.modes import FULL, KEEP, SELECTIVE
from memplan.profile import Segment

_EXACT_INT = 1 << 53
"""Micro-batches up to this convert to float64 exactly (as Python's ``s * b`` does)."""

_points_cache: OrderedDict[tuple[int, str], tuple[Sequence[Segment], object]] = OrderedDict()
_tops_cache: OrderedDict[tuple[int, str, int], tuple[Sequence[Segment], list[int]]] = OrderedDict()
_CACHE_SIZE = 16


def _variant(segment: Segment, mode: str) -> tuple:
    """The points ``segment_points_bytes`` reads for the active layer in ``mode``."""
    if segment.active == "none" or mode not in (FULL, SELECTIVE):
        return segment.points
    return segment.ckpt_points if mode == FULL else segment.selective_points


def _arrays(segments: Sequence[Segment], mode: str) -> tuple | None:
    """(intercepts, slopes, start of each segment) for ``mode``, cached per timeline; None
    when some segment has no point there (the caller's per-segment path raises)."""
    key = (id(segments), mode)
    hit = _points_cache.get(key)
    if hit is not None and hit[0] is segments:
        _points_cache.move_to_end(key)
        return hit[1]  # type: ignore[return-value]
    starts, intercepts, slopes = [], [], []
    arrays: tuple | None = None
    for segment in segments:
        points = _variant(segment, mode)
        if not points:
            break
        starts.append(len(intercepts))
        for a, s in points:
            intercepts.append(a)
            slopes.append(s)
    else:
        arrays = (
            np.asarray(intercepts, dtype=np.float64),
            np.asarray(slopes, dtype=np.float64),
            np.asarray(starts, dtype=np.intp),
        )
    _points_cache[key] = (segments, arrays)
    if len(_points_cache) > _CACHE_SIZE:
        _points_cache.popitem(last=False)
    return arrays


def segment_tops_bytes(segments: Sequence[Segment], micro_batch: int, mode: str) -> list[int]:
    """``segment_points_bytes(segment, micro_batch, mode)`` for every segment, in order,
    with the active layer in ``mode`` (keep for the segments with no active layer)."""
    from memplan.memory.terms import segment_points_bytes  # terms imports this module

    mode = mode if mode in (FULL, SELECTIVE) else KEEP
    if not segments:
        return []
    key = (id(segments), mode, micro_batch)
    hit = _tops_cache.get(key)
    if hit is not None and hit[0] is segments:
        _tops_cache.move_to_end(key)
        return hit[1]
    arrays = _arrays(segments, mode) if abs(micro_batch) <= _EXACT_INT else None
    if arrays is None:  # the one-by-one path, with its errors
        tops = [segment_points_bytes(segment, micro_batch, mode) for segment in segments]
    else:
        intercepts, slopes, starts = arrays
        with np.errstate(all="ignore"):  # inf or NaN points fail in math.ceil, as one by one
            values = intercepts + slopes * np.float64(micro_batch)
        tops = [math.ceil(top) for top in np.maximum.reduceat(values, starts).tolist()]
    _tops_cache[key] = (segments, tops)
    if len(_tops_cache) > _CACHE_SIZE:
        _tops_cache.popitem(last=False)
    return tops
