"""Affine fits over the probed micro-batch sizes, and pruning of dominated timeline points.

A live-byte count at a fixed point of the op sequence is affine in the micro-batch ``b``;
a peak (a maximum over points) is not. So points are fitted one by one, and only maxima of
fitted points are ever taken.
"""

from __future__ import annotations

from collections.abc import Sequence

from memplan.profile import Affine, Point


def fit_affine(sizes: Sequence[int], values: Sequence[float]) -> Affine:
    """Least-squares ``intercept + slope * b`` through ``(sizes[i], values[i])``; one size
    gives a constant. ``residual`` is the largest |measured − fitted| / max(|measured|, 1)."""
    n = len(sizes)
    if n != len(values) or n == 0:
        raise ValueError("fit_affine needs one value per size")
    mean_b = sum(sizes) / n
    mean_y = sum(values) / n
    var_b = sum((b - mean_b) ** 2 for b in sizes)
    if var_b == 0:
        slope = 0.0
    else:
        slope = sum((b - mean_b) * (y - mean_y) for b, y in zip(sizes, values, strict=True)) / var_b
    intercept = mean_y - slope * mean_b
    residual = max(
        abs(y - (intercept + slope * b)) / max(abs(y), 1.0)
        for b, y in zip(sizes, values, strict=True)
    )
    # Whole bytes stay whole when the fit is exact (the usual case): no 1e-12 noise in YAML.
    if residual < 1e-12:
        scale = max(abs(y) for y in values)
        intercept, slope, residual = _tidy(intercept, scale), _tidy(slope, scale), 0.0
    return Affine(intercept=intercept, slope=slope, residual=residual)


def fit_seconds(sizes: Sequence[int], values: Sequence[float]) -> Affine:
    """A time fit with ``intercept >= 0`` and ``slope >= 0`` (least squares under those
    bounds). Times are noisy: an unconstrained line through three noisy points can cross
    zero at micro-batch 1 and make a tiny micro-batch look free, which would decide a plan.
    A time does not shrink as the batch grows, nor go below zero at no batch."""
    free = fit_affine(sizes, values)
    if free.intercept >= 0 and free.slope >= 0:
        return free
    pairs = list(zip(sizes, values, strict=True))
    squares = sum(b * b for b, _ in pairs)
    through_origin = max(sum(b * y for b, y in pairs) / squares, 0.0) if squares else 0.0
    constant = max(sum(values) / len(values), 0.0)
    options = [(0.0, through_origin), (constant, 0.0)]

    def error(option: tuple[float, float]) -> float:
        return sum((y - option[0] - option[1] * b) ** 2 for b, y in pairs)

    intercept, slope = min(options, key=error)
    residual = max(abs(y - (intercept + slope * b)) / max(abs(y), 1.0) for b, y in pairs)
    return Affine(intercept=intercept, slope=slope, residual=residual)


def _tidy(x: float, scale: float) -> float:
    r = round(x)
    return float(r) if abs(x - r) <= 1e-9 * scale else x


def undominated(points: Sequence[Point]) -> tuple[Point, ...]:
    """Points that can be the maximum for some micro-batch ``b >= 1``: drop every point
    whose value at ``b = 1`` and slope are both ≤ another's (exact duplicates kept once).
    A point that bounds only below one sample (a higher intercept, a lower slope) is never
    the peak of a step, and keeping it would make two probes of one model differ where
    their predictions agree (mBART's meta and cpu profiles did). Order of first
    appearance is kept, so the result still reads along the op sequence."""
    order = sorted(
        range(len(points)), key=lambda i: (-(points[i][0] + points[i][1]), -points[i][1], i)
    )
    keep: set[int] = set()
    best_slope = float("-inf")
    for i in order:
        if points[i][1] > best_slope:
            keep.add(i)
            best_slope = points[i][1]
    return tuple(points[i] for i in sorted(keep))


def add_affine(point: Point, shift: Affine) -> Point:
    return (point[0] + shift.intercept, point[1] + shift.slope)


def sum_affine(items: Sequence[Affine]) -> Affine:
    return Affine(intercept=sum(a.intercept for a in items), slope=sum(a.slope for a in items))
