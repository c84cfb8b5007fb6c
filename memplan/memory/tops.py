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
from collections.abc import Mapping, Sequence

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


_tops_float_cache: OrderedDict[tuple[int, str, int], tuple[Sequence[Segment], object]] = (
    OrderedDict()
)
_held_cache: OrderedDict[int, tuple[Sequence[Segment], tuple]] = OrderedDict()


def _remember(cache: OrderedDict, key: object, segments: Sequence[Segment], value: object) -> None:
    cache[key] = (segments, value)
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def segment_tops_float(
    segments: Sequence[Segment], micro_batch: int, mode: str
) -> np.ndarray | None:
    """Every segment's highest point at ``micro_batch`` in ``mode`` as float64, before
    rounding up (``segment_tops_bytes`` is ``math.ceil`` of each); None when it cannot be
    had exactly this way (a segment with no point in that mode, a micro-batch over 2^53)
    or a point is not finite: the callers take the one-by-one path then."""
    mode = mode if mode in (FULL, SELECTIVE) else KEEP
    key = (id(segments), mode, micro_batch)
    hit = _tops_float_cache.get(key)
    if hit is not None and hit[0] is segments:
        _tops_float_cache.move_to_end(key)
        return hit[1]  # type: ignore[return-value]
    arrays = _arrays(segments, mode) if segments and abs(micro_batch) <= _EXACT_INT else None
    tops = None
    if arrays is not None:
        intercepts, slopes, starts = arrays
        with np.errstate(all="ignore"):
            values = intercepts + slopes * np.float64(micro_batch)
        if np.isfinite(values).all():
            tops = np.maximum.reduceat(values, starts)
    _remember(_tops_float_cache, key, segments, tops)
    return tops


def held_layout(segments: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """Per segment: ``held`` and whether a layer is active, as arrays, cached per timeline."""
    key = id(segments)
    hit = _held_cache.get(key)
    if hit is not None and hit[0] is segments:
        return hit[1]
    layout = (
        np.fromiter((seg.held for seg in segments), dtype=np.intp, count=len(segments)),
        np.fromiter((seg.active != "none" for seg in segments), dtype=bool, count=len(segments)),
    )
    _remember(_held_cache, key, segments, layout)
    return layout


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


_INT64_SAFE = 1 << 62
"""Integers below this in magnitude take int64 arithmetic here without overflow."""


def first_highest_segment(
    timeline: dict[str, Sequence[Segment]],
    phases: Sequence[str],
    micro_batch: int,
    layer_modes: Mapping[int, str],
    held_bytes: Sequence[int],
) -> tuple[int, str, int] | None:
    """One process's highest segment value over ``phases`` in order and its first place,
    ``(allocated bytes, phase, index)``: each segment's top in its active layer's mode
    (memory.peak's walk) less ``held_bytes[held]``, in array operations. The values are
    the walk's to the byte (``math.ceil`` and ``np.ceil`` agree, and int64 holds them: it
    answers None otherwise, and when some phase has no float tops, for the walk to do)."""
    try:
        held = np.array(held_bytes, dtype=np.int64)
    except OverflowError:
        return None
    if held.size and int(np.abs(held).max()) >= _INT64_SAFE:
        return None
    modes = [KEEP, *sorted(set(layer_modes.values()) - {KEEP})]
    mode_index = np.zeros(max(len(held) - 1, 1), dtype=np.intp)
    for j, mode in layer_modes.items():
        mode_index[j] = modes.index(mode)
    best: tuple[int, str, int] | None = None
    for phase in phases:
        segments = timeline[phase]
        tops = [segment_tops_float(segments, micro_batch, mode) for mode in modes]
        if any(top is None for top in tops):
            return None
        held_at, is_active = held_layout(segments)
        if len(modes) == 1:
            top = tops[0]
        else:  # a segment with no active layer reads its plain points in every mode
            rows = np.where(is_active, mode_index[np.minimum(held_at, len(mode_index) - 1)], 0)
            top = np.stack(tops)[rows, np.arange(len(segments))]
        rounded = np.ceil(top)
        if float(np.abs(rounded).max()) >= _INT64_SAFE:
            return None
        values = rounded.astype(np.int64) - held[held_at]
        at = int(np.argmax(values))  # the first of equal highest
        if best is None or int(values[at]) > best[0]:
            best = (int(values[at]), phase, at)
    return best
