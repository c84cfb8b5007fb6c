"""The profile of a model whose run of identical blocks is ``n`` long, from the profiles of
the same model with the run cut to 4 and 5 blocks (memplan.probe.repeats says why that is
exact, and how it is checked).

Candidate layers of a cut profile fall in three classes, by index ``h`` relative to the
run's first candidate ``a`` and its cut length ``r``: *head* (``h <= a + 1``: before the
run, and its first two blocks), *mid* (``a + 2 <= h <= a + r - 2``) and *tail* (the run's
last block and all after it, keyed by ``h - r``). A head or tail quantity ``V`` is linear
in the run's length: ``V(n) = V(4) + (n - 4) * (V(5) - V(4))``. The ``i``-th mid block's
segments are the first mid block's at ``n`` plus ``i`` times the step between the two mid
blocks of the 5-block profile. Unpruned points are extrapolated and pruned afterwards, as
a full probe prunes them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from memplan.probe.fitting import undominated
from memplan.profile import Affine, Layer, Profile, Segment, SharedInput


class NotLinear(Exception):
    """The cut profiles do not extrapolate (a difference where none may be): probe in full."""


def _lin(v4: Any, v5: Any, t: int) -> Any:
    """``v4 + t * (v5 - v4)`` through numbers, tuples and frozen dataclasses; anything else
    must be equal in both."""
    if v4 == v5 and not isinstance(v4, tuple | list):
        return v4
    if isinstance(v4, bool) or isinstance(v5, bool):
        raise NotLinear(f"{v4!r} != {v5!r}")
    if isinstance(v4, int | float) and isinstance(v5, int | float):
        out = v4 + t * (v5 - v4)
        return int(out) if isinstance(v4, int) and isinstance(v5, int) else float(out)
    if isinstance(v4, tuple | list) and isinstance(v5, tuple | list):
        if len(v4) != len(v5):
            raise NotLinear(f"lengths {len(v4)} != {len(v5)}")
        return type(v4)(_lin(a, b, t) for a, b in zip(v4, v5, strict=True))
    if isinstance(v4, Affine) and isinstance(v5, Affine):
        return Affine(
            intercept=_lin(v4.intercept, v5.intercept, t),
            slope=_lin(v4.slope, v5.slope, t),
            residual=max(v4.residual, v5.residual),
        )
    if dataclasses.is_dataclass(v4) and type(v4) is type(v5):
        changes = {
            f.name: _lin(getattr(v4, f.name), getattr(v5, f.name), t)
            for f in dataclasses.fields(v4)
        }
        return dataclasses.replace(v4, **changes)
    raise NotLinear(f"{v4!r} != {v5!r}")


def _cls(h: int, a: int, r: int) -> tuple[str, int]:
    if h <= a + 1:
        return ("head", h)
    if h <= a + r - 2:
        return ("mid", h - a - 2)
    return ("tail", h - r)


def _keyed(segments: Sequence[Segment], a: int, r: int) -> list[tuple[tuple, Segment]]:
    seen: dict[tuple, int] = {}
    out = []
    for seg in segments:
        base = (*_cls(seg.held, a, r), seg.active)
        occ = seen.get(base, 0)
        seen[base] = occ + 1
        out.append(((*base, occ), seg))
    return out


def _seg_lin(s4: Segment, s5: Segment, t: int, held: int) -> Segment:
    if s4.active != s5.active:
        raise NotLinear("segments differ in what runs")
    if s4.shared_live != s5.shared_live:
        raise NotLinear("segments differ in the shared inputs alive")
    return Segment(
        held=held,
        active=s4.active,
        points=_points(s4.points, s5.points, t),
        ckpt_points=_points(s4.ckpt_points, s5.ckpt_points, t),
        selective_points=_points(s4.selective_points, s5.selective_points, t),
        shared_live=s4.shared_live,
    )


def _points(p4: tuple, p5: tuple, t: int) -> tuple:
    """``_lin`` for a segment's points (the hot path: 40,000 segments at 10,000 layers)."""
    if len(p4) != len(p5):
        raise NotLinear("segments differ in points")
    return tuple(
        (a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1])) for a, b in zip(p4, p5, strict=True)
    )


def _timeline(
    p4: Sequence[Segment], p5: Sequence[Segment], a: int, n: int, prune: bool
) -> tuple[Segment, ...]:
    k4 = dict(_keyed(p4, a, 4))
    k5 = _keyed(p5, a, 5)
    d5 = dict(k5)
    if set(k4) != {k for k in d5 if not (k[0] == "mid" and k[1] == 1)}:
        raise NotLinear("the cut profiles' segments differ")
    t = n - 4
    out: list[Segment] = []
    j = 0
    while j < len(k5):
        key, _ = k5[j]
        kind, idx = key[0], key[1]
        if kind == "head":
            out.append(_seg_lin(k4[key], d5[key], t, idx))
        elif kind == "tail":
            out.append(_seg_lin(k4[key], d5[key], t, idx + n))
        else:
            stretch = []
            while j < len(k5) and k5[j][0][0] == "mid":
                stretch.append(k5[j][0])
                j += 1
            ascending = stretch[0][1] == 0
            # each pattern segment's base (its line through the cut profiles) and its step
            # from one middle block to the next, the same for every block: found once
            pattern = [
                (_seg_lin(k4[k], d5[k], t, a + 2), d5[k], d5[(k[0], 1, *k[2:])])
                for k in stretch
                if k[1] == 0
            ]
            for i in range(n - 3) if ascending else reversed(range(n - 3)):
                for base, first, second in pattern:
                    out.append(_mid_at(base, first, second, i, a + 2 + i))
            continue
        j += 1
    if prune:
        out = [
            dataclasses.replace(
                s,
                points=undominated(s.points),
                ckpt_points=undominated(s.ckpt_points),
                selective_points=undominated(s.selective_points),
            )
            for s in out
        ]
    return tuple(out)


def _mid_at(base: Segment, first: Segment, second: Segment, i: int, held: int) -> Segment:
    """``base`` plus ``i`` times (``second`` − ``first``)."""

    def at(b: tuple, f: tuple, s: tuple) -> tuple:
        if not (len(b) == len(f) == len(s)):
            raise NotLinear("mid segments differ in points")
        return tuple(
            (p[0] + i * (q[0] - r[0]), p[1] + i * (q[1] - r[1]))
            for p, r, q in zip(b, f, s, strict=True)
        )

    if not base.shared_live == first.shared_live == second.shared_live:
        raise NotLinear("mid segments differ in the shared inputs alive")
    return Segment(
        held=held,
        active=base.active,
        shared_live=base.shared_live,
        points=at(base.points, first.points, second.points),
        ckpt_points=at(base.ckpt_points, first.ckpt_points, second.ckpt_points),
        selective_points=at(base.selective_points, first.selective_points, second.selective_points),
    )


def _same_but_name(x: Layer, y: Layer) -> bool:
    """Equal bytes; seconds (virtual, fitted) within 1e-9."""
    return _close(dataclasses.replace(x, name=""), dataclasses.replace(y, name=""))


def expand(p4: Profile, p5: Profile, a: int, n: int, names: Sequence[str], prune: bool) -> Profile:
    """The profile at run length ``n`` (the run's first candidate is ``a``; ``names`` are
    the full model's candidates). ``p4`` and ``p5`` hold unpruned points."""
    l4, l5 = p4.layers, p5.layers
    if len(l5) != len(l4) + 1 or len(names) != len(l4) + n - 4:
        raise NotLinear(  # the probe left candidates out: layers that cannot be checkpointed
            f"layer counts: the cuts to 4 and 5 blocks kept {len(l4)} and {len(l5)} "
            "checkpoint candidates, where each block of the run adds one"
        )
    mid = l5[a + 2]
    if not (_same_but_name(mid, l5[a + 3]) and _same_but_name(mid, l4[a + 2])):
        raise NotLinear("the run's middle blocks differ")
    if not all(_same_but_name(x, y) for x, y in zip(l4, l5[: a + 2], strict=False)):
        raise NotLinear("head layers differ")
    if not all(_same_but_name(x, y) for x, y in zip(l4[a + 3 :], l5[a + 4 :], strict=True)):
        raise NotLinear("tail layers differ")
    layers = [*l4[: a + 2], *([mid] * (n - 3)), *l4[a + 3 :]]
    layers = [dataclasses.replace(x, name=name) for x, name in zip(layers, names, strict=True)]
    t = n - 4
    timeline = {
        phase: _timeline(p4.timeline[phase], p5.timeline[phase], a, n, prune)
        for phase in p4.timeline
    }
    rest = {
        f.name: _lin(getattr(p4, f.name), getattr(p5, f.name), t)
        for f in dataclasses.fields(Profile)
        if f.name
        not in (
            "layers",
            "timeline",
            "deduplicated_layers",
            "extrapolated_layers",
            "extrapolation_declined",
            "seq",
            "shared_inputs",
        )
    }
    return Profile(
        **rest,
        shared_inputs=_shared_inputs(p4, p5, a, n),
        layers=tuple(layers),
        timeline=timeline,
        deduplicated_layers=tuple(names[a + 3 : a + n - 1]),
        extrapolated_layers=tuple(names[a + 3 : a + n - 1]),
    )


def _shared_inputs(p4: Profile, p5: Profile, a: int, n: int) -> tuple[SharedInput, ...]:
    """The shared inputs at run length ``n``: head and tail layers as in the cut profiles,
    and every middle block or none (a pattern over the run's blocks does not extrapolate
    from two middle blocks: probe in full)."""
    if len(p4.shared_inputs) != len(p5.shared_inputs):
        raise NotLinear("the cut profiles share different inputs")
    out = []
    for s4, s5 in zip(p4.shared_inputs, p5.shared_inputs, strict=True):
        if not _close(s4.bytes, s5.bytes):
            raise NotLinear("a shared input's bytes differ")
        classes4 = [_cls(h, a, 4) for h in s4.layers]
        classes5 = [_cls(h, a, 5) for h in s5.layers]
        mids = sorted(i for kind, i in classes5 if kind == "mid")
        if mids not in ([], [0, 1]) or [c for c in classes4 if c[0] != "mid"] != [
            c for c in classes5 if c[0] != "mid"
        ]:
            raise NotLinear("a shared input's layers do not extrapolate")
        head = [i for kind, i in classes5 if kind == "head"]
        tail = [i + n for kind, i in classes5 if kind == "tail"]
        middle = list(range(a + 2, a + n - 1)) if mids else []
        out.append(SharedInput(bytes=s4.bytes, layers=tuple(sorted({*head, *middle, *tail}))))
    return tuple(out)


def _close(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        if x == y:
            return True
        if x.is_integer() and y.is_integer():
            return False  # bytes: exact
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(x, tuple | list) and isinstance(y, tuple | list):
        return len(x) == len(y) and all(_close(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x)
    if dataclasses.is_dataclass(x) and type(x) is type(y):
        return all(
            _close(getattr(x, f.name), getattr(y, f.name))
            for f in dataclasses.fields(x)
            if f.name != "residual"
        )
    return x == y


def same_profile(predicted: Profile, measured: Profile) -> bool:
    """Equal bytes, seconds within 1e-9, fit residuals aside; names and derived-layer lists
    aside (a cut model's layers are named by their cut positions)."""
    strip = {"deduplicated_layers": (), "extrapolated_layers": ()}
    a = dataclasses.replace(predicted, **strip)
    b = dataclasses.replace(measured, **strip)
    if len(a.layers) != len(b.layers):
        return False
    return _close(_unnamed(a.layers), _unnamed(b.layers)) and _close(
        dataclasses.replace(a, layers=b.layers), b
    )


def _unnamed(layers: Sequence[Layer]) -> list[Layer]:
    return [dataclasses.replace(x, name="") for x in layers]
