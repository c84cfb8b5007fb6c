"""The sequence length: fit a profile probed at several lengths, evaluate it at another.

No torch here (docs/design.md, "Sequence length"). ``memplan probe --seq-lens 64,128``
stores one profile per probed length (``Profile.seq``), each with the same timeline points
in the same order. A plan at length ``S`` is the ordinary solve on ``profile_at(profile,
S)``: every quantity the probe fits in the micro-batch ``b``,

    q(b, s) = intercept(s) + slope(s) · b,

is fitted across the probed lengths ``s``, intercept and slope separately, in the first of
these forms (powers of ``s``) that fits:

    slope (per sample):         {1}  {s}      {1, s}   {s, s²}  {1, s, s²}
    intercept (per micro-step): {1}  {1, s}   {1, s²}  {s, s²}  {1, s, s²}
      ... when its slope has s²: {1}  {1, s²}  {1, s}   {s, s²}  {1, s, s²}

A form *fits* when every measured length is within ``FORM_TOLERANCE`` and its
coefficients do not have opposite signs. That last rule is physics, not numerics: the live
bytes at a point are a sum of tensors, each of ``b^i · s^j`` elements times a positive
size, so no coefficient of a true fit is negative — but for one: a tensor one token
shorter than the batch (``s − 1``: a causal LM's shifted logits), allowed in ``{1, s}``. Per sample (the slope), a tensor is per
token (``s``: hidden states, logits) or per token pair (``s²``: the scores of eager
attention); per micro-step (the intercept), parameters and state (``1``), position
buffers (``s``) and causal masks without a batch dimension (``s²``, nanoGPT's
``bias[:T, :T] == 0``). With two lengths only two-term forms are identified, and the
order above is the choice: for a slope, linear growth per token where the two lengths say
so (a slope that doubles), else a per-token and a per-token-pair part (a slope that grows
between 2× and 4× when the length doubles). For an intercept that grows, a position buffer
(``s``) unless the same point keeps per-token-pair tensors per sample (its slope has an
``s²`` part): only then is a mask of ``s × s`` likely (eager attention). Guessing ``s²`` for
a position buffer over-counts without bound as the length grows (rotary tables at 64× the
probed length); guessing ``s`` for a mask under-counts by a bounded share of the scores it
masks (measured on the test GPT: −3.4% at 8×). A third length decides either way.

A quantity that fits no form is flagged in the profile's warnings, as a non-affine layer is
flagged today: one that shrinks as the length grows is held at its largest value, one that
grows faster than ``s²`` is fitted in the richest form by least squares.

Times follow FLOPs: a layer's time per sample at ``S`` is its time at the longest probed
length scaled by its FLOPs per sample (fitted as bytes are, exactly: matmuls ``s``,
attention scores ``s²``); without FLOPs, by tokens. Times per micro-step (overhead) and
the optimizer step do not change with the length.

Peaks are non-decreasing in ``S`` when every fit has non-negative coefficients, so the
longest length that has a plan is found by bisection over multiples (memplan.solver.seqlen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from memplan.errors import BadInputError
from memplan.profile import Affine, FixedPart, Layer, Point, Profile, Segment

PER_SAMPLE_FORMS: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 1), (1, 2), (0, 1, 2))
"""Powers of ``s`` in each form of a slope (bytes per sample), in the order they are tried."""
PER_STEP_FORMS: tuple[tuple[int, ...], ...] = ((0,), (0, 1), (0, 2), (1, 2), (0, 1, 2))
"""The same for an intercept (bytes per micro-step, no batch dimension): a position buffer
of ``s`` before a mask of ``s × s``; two lengths cannot tell them apart (module docstring)."""
PER_STEP_FORMS_WITH_PAIRS: tuple[tuple[int, ...], ...] = ((0,), (0, 2), (0, 1), (1, 2), (0, 1, 2))
"""The order for an intercept whose slope holds a per-token-pair part (``s²``)."""
FORM_TOLERANCE = 1e-6
"""Largest |measured − fitted| / max(|measured|, 1) at a probed length for a form to fit.
Bytes are counted exactly, so a form fits or it does not: a loose tolerance would let the
parameters (a large constant) hide a mask of ``s × s`` bytes that dominates at 8× the
length."""
SHIFT_TOKENS = 1
"""A per-token part may come with ``−k`` tokens (``s − 1``: shifted logits and labels), for
``k`` up to this. More would read a small per-token-pair part as a shift: a slope that grows
2.016× from 64 to 128 tokens is either ``a·(s − 1)``-like or a token-pair part of 1.6%
(11% at 1024 tokens, then under-counted); one token is the shift a causal LM has."""
MAX_SEQ_LEN = 2**24
"""Longest length memplan plans (16M tokens per sample); beyond it no model has positions."""
DEFAULT_SEQ_MULTIPLE = 64
"""``--seq-len max`` steps: lengths that tile well on tensor cores."""


class SeqLenError(BadInputError):
    """A sequence length memplan cannot plan, or a profile without lengths (exit 2)."""


# ------------------------------------------------------------------------------ fitting
@dataclass(frozen=True, slots=True)
class SeqFit:
    """``value(s) = Σ coefficients[i] · (s / scale) ** powers[i]``."""

    powers: tuple[int, ...]
    coefficients: tuple[float, ...]
    scale: float
    """The longest probed length (keeps the powers of ``s`` near 1)."""
    residual: float
    fits: bool
    """False: no form fitted (flagged); this is the richest form's least-squares fit."""

    def at(self, seq_len: float) -> float:
        x = seq_len / self.scale
        value = sum(c * x**p for c, p in zip(self.coefficients, self.powers, strict=True))
        # Whole bytes stay whole: memplan.memory rounds points up, and 48736.0000001 is not
        # a byte more than 48736.
        whole = round(value)
        return float(whole) if abs(value - whole) <= 1e-9 * max(abs(value), 1.0) else value

    def by_power(self) -> tuple[float, float, float]:
        """Coefficients of ``1, s, s²`` (in units of ``scale``), zero where absent."""
        out = [0.0, 0.0, 0.0]
        for c, p in zip(self.coefficients, self.powers, strict=True):
            out[p] = c
        return out[0], out[1], out[2]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


def _least_squares(xs: Sequence[float], ys: Sequence[float], powers: Sequence[int]) -> list[float]:
    rows = [[x**p for p in powers] for x in xs]
    k = len(powers)
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    rhs = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    solved = _solve(normal, rhs)
    return solved if solved is not None else [0.0] * k


def fit_pair(
    seq_lens: Sequence[int], intercepts: Sequence[float], slopes: Sequence[float]
) -> tuple[SeqFit, SeqFit]:
    """``(intercept fit, slope fit)`` of an affine quantity across lengths: the slope first,
    then the intercept in the order its slope says (module docstring)."""
    slope = fit_seq(seq_lens, slopes)
    pairs = slope.by_power()[2] > 0
    return fit_seq(seq_lens, intercepts, per_sample=False, pairs=pairs), slope


def fit_seq(
    seq_lens: Sequence[int],
    values: Sequence[float],
    *,
    per_sample: bool = True,
    pairs: bool = False,
) -> SeqFit:
    """The first form that fits ``values`` at ``seq_lens`` (module docstring), of
    ``PER_SAMPLE_FORMS``, or for an intercept (``per_sample`` False) of ``PER_STEP_FORMS``,
    ``PER_STEP_FORMS_WITH_PAIRS`` when its slope has a per-token-pair part (``pairs``).
    Only forms with no more terms than lengths are tried."""
    if len(seq_lens) != len(values) or len(seq_lens) < 2:
        raise ValueError("fit_seq needs one value per length, at two lengths or more")
    scale = float(max(seq_lens))
    xs = [s / scale for s in seq_lens]
    top = max(abs(v) for v in values)
    if per_sample:
        forms = PER_SAMPLE_FORMS
    else:
        forms = PER_STEP_FORMS_WITH_PAIRS if pairs else PER_STEP_FORMS
    tried = [f for f in forms if len(f) <= len(seq_lens)]
    for powers in tried:
        coefficients = _least_squares(xs, values, powers)
        fit = _make(powers, coefficients, scale, xs, values, fits=True)
        slack = 1e-9 * max(top, 1.0)
        same_sign = all(c >= -slack for c in coefficients) or all(c <= slack for c in coefficients)
        if fit.residual <= FORM_TOLERANCE and (same_sign or _shifted(powers, coefficients, scale)):
            return fit
    if values[-1] < max(values):
        # Shrinks as the length grows: no sum of tensors does. Hold the largest value.
        return _make((0,), [max(values)], scale, xs, values, fits=False)
    richest = tried[-1]
    return _make(richest, _least_squares(xs, values, richest), scale, xs, values, fits=False)


def _shifted(powers: tuple[int, ...], coefficients: Sequence[float], scale: float) -> bool:
    """``c·(s − k)`` with ``0 < k ≤ SHIFT_TOKENS``: the one negative coefficient a sum of
    tensors has, from tensors one token shorter than the batch (a causal LM's shifted
    logits and labels, ``logits[:, :-1]``)."""
    if powers != (0, 1) or coefficients[1] <= 0:
        return False
    per_token = coefficients[1] / scale
    return -SHIFT_TOKENS * per_token <= coefficients[0] < 0


def _make(
    powers: tuple[int, ...],
    coefficients: Sequence[float],
    scale: float,
    xs: Sequence[float],
    values: Sequence[float],
    *,
    fits: bool,
) -> SeqFit:
    top = max((abs(v) for v in values), default=0.0)
    # Whole bytes stay whole: drop float noise far below a byte of the largest value.
    tidy = tuple(0.0 if abs(c) <= 1e-12 * max(top, 1.0) else c for c in coefficients)
    fit = SeqFit(powers, tidy, scale, 0.0, fits)
    residual = max(
        abs(v - fit.at(x * scale)) / max(abs(v), 1.0) for x, v in zip(xs, values, strict=True)
    )
    return dataclasses.replace(fit, residual=residual if residual > 1e-12 else 0.0)


# --------------------------------------------------------------------------- evaluating
def require_grid(profile: Profile, *, flag: str = "--seq-len") -> None:
    """SeqLenError (exit 2) unless ``profile`` was probed at several lengths."""
    if profile.seq is None:
        raise SeqLenError(
            f"{flag}: the profile of {profile.model.spec} was probed at "
            + (
                f"one length ({profile.seq_len})"
                if profile.seq_len
                else "the model file's own batches"
            )
            + ", so it cannot say how memory grows with the length.",
            hint=f"Probe again at two lengths or more: memplan probe {profile.model.spec} "
            "--seq-lens 128,256 (make_batch(batch_size, seq_len) makes the batches).",
        )


def check_seq_len(seq_len: object, *, flag: str = "--seq-len") -> int:
    """``seq_len`` as a length memplan can plan, else SeqLenError naming ``flag``."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise SeqLenError(f"{flag} must be a whole number of tokens, got {seq_len!r}.")
    if seq_len < 1:
        raise SeqLenError(f"{flag} must be at least 1 token, got {seq_len}.")
    if seq_len > MAX_SEQ_LEN:
        raise SeqLenError(
            f"{flag} {seq_len} is longer than any model's context ({MAX_SEQ_LEN} tokens is "
            "the most memplan plans).",
            hint="Give the length your batches have.",
        )
    return seq_len


def parse_seq_len(text: str, *, flag: str = "--seq-len", allow_max: bool = True) -> int | None:
    """``--seq-len`` text: a positive whole number, or ``max`` (None) where ``allow_max``."""
    cleaned = text.strip().lower()
    if cleaned == "max" and allow_max:
        return None
    try:
        value = int(cleaned.replace("_", ""), 10)
    except ValueError:
        # (--seq-lens was offered "or max", which it then refused)
        other = ", or max" if allow_max else " (lengths only, such as 128,256)"
        raise SeqLenError(
            f"{flag} {text!r} is not a length: give a whole number of tokens{other}."
        ) from None
    return check_seq_len(value, flag=flag)


def parse_seq_lens(text: str) -> tuple[int, ...]:
    """``--seq-lens 64,128``: distinct positive lengths, ascending."""
    parts = [p for p in (x.strip() for x in text.split(",")) if p]
    if not parts:
        raise SeqLenError("--seq-lens is empty: give lengths such as 128,256.")
    lens = []
    for part in parts:
        if part.lower() == "max":
            raise SeqLenError("--seq-lens takes lengths, not max: e.g. 128,256.")
        value = parse_seq_len(part, flag="--seq-lens", allow_max=False)
        assert value is not None
        lens.append(value)
    return tuple(sorted(set(lens)))


def undominated_vectors(vectors: Sequence[Sequence[float]]) -> list[int]:
    """Indices (ascending) of the vectors no other vector is >= in every coordinate (exact
    duplicates kept once). With coordinates the non-negative coefficients of monomials in
    ``b, s >= 0``, a dropped vector can never be the maximum."""
    order = sorted(range(len(vectors)), key=lambda i: (-sum(vectors[i]), i))
    kept: list[int] = []
    for i in order:
        v = vectors[i]
        if not any(all(a >= b for a, b in zip(vectors[k], v, strict=True)) for k in kept):
            kept.append(i)
    return sorted(kept)


class SeqModel:
    """A grid profile's quantities fitted across lengths (each fit made once, on first use),
    evaluated as a Profile at any length by ``at``."""

    def __init__(self, profile: Profile) -> None:
        require_grid(profile)
        assert profile.seq is not None
        self.profile = profile
        self.lens = profile.seq.seq_lens
        self.profiles = profile.seq.profiles
        self._fits: dict[str, SeqFit] = {}
        self.unfit: dict[str, None] = {}

    def fit(self, path: str, values: Sequence[float]) -> SeqFit:
        """A per-sample quantity (a slope, FLOPs per sample) across lengths, fitted once."""
        fit = self._fits.get(path)
        if fit is None:
            fit = self._fits[path] = fit_seq(self.lens, values)
            if not fit.fits:
                self.unfit[path] = None
        return fit

    def pair(
        self, path: str, intercepts: Sequence[float], slopes: Sequence[float], s: int
    ) -> tuple[float, float]:
        """An affine quantity (or timeline point) at ``s``: ``(intercept, slope)``."""
        key = f"{path}.intercept"
        fits = self._fits.get(key), self._fits.get(f"{path}.slope")
        if fits[0] is None or fits[1] is None:
            fits = fit_pair(self.lens, intercepts, slopes)
            self._fits[key], self._fits[f"{path}.slope"] = fits
            for name, fit in zip((key, f"{path}.slope"), fits, strict=True):
                if not fit.fits:
                    self.unfit[name] = None
        return fits[0].at(s), fits[1].at(s)

    def at(self, seq_len: int) -> Profile:
        """The profile at ``seq_len`` tokens per sample: an ordinary Profile (no ``seq``)
        the solver, timing and memory models read as they read a probed one."""
        s = check_seq_len(seq_len)
        last = self.profiles[-1]
        layers = tuple(
            self._part(f"layers[{j}]", [p.layers[j] for p in self.profiles], s)
            for j in range(len(last.layers))
        )
        fixed = tuple(
            self._part(f"fixed[{j}]", [p.fixed[j] for p in self.profiles], s)
            for j in range(len(last.fixed))
        )
        fixed_flops = [
            Affine(
                intercept=sum(f.fwd_flops.intercept for f in p.fixed),
                slope=sum(f.fwd_flops.slope for f in p.fixed),
            )
            for p in self.profiles
        ]
        timeline = {
            phase: tuple(
                self._segment(
                    f"timeline.{phase}[{k}]", [p.timeline[phase][k] for p in self.profiles], s
                )
                for k in range(len(segments))
            )
            for phase, segments in last.timeline.items()
        }
        return dataclasses.replace(
            last,
            layers=layers,
            fixed=fixed,
            timeline=timeline,
            optimizer_step_peak_bytes=self._affine(
                "optimizer_step_peak_bytes", [p.optimizer_step_peak_bytes for p in self.profiles], s
            ),
            step_fixed_seconds=_scaled(
                last.step_fixed_seconds, self._flops_ratio("fixed", fixed_flops, s)
            ),
            warnings=self.profile.warnings,
            seq_len=s,
            seq=None,
        )

    # -------------------------------------------------------------------- pieces
    def _affine(self, path: str, items: Sequence[Affine], s: int) -> Affine:
        intercept, slope = self.pair(
            path, [a.intercept for a in items], [a.slope for a in items], s
        )
        return Affine(intercept=intercept, slope=slope, residual=max(a.residual for a in items))

    def _flops_ratio(self, path: str, flops: Sequence[Affine], s: int) -> float:
        """Growth of FLOPs per sample from the longest probed length to ``s``; of tokens
        when the probe counted none."""
        longest = flops[-1].slope
        if longest <= 0:
            return s / self.lens[-1]
        fit = self.fit(f"{path}.fwd_flops.slope", [f.slope for f in flops])
        return max(fit.at(s), 0.0) / longest

    def _part(self, path: str, items: Sequence[Layer | FixedPart], s: int) -> Layer | FixedPart:
        last = items[-1]
        ratio = self._flops_ratio(path, [i.fwd_flops for i in items], s)
        changes: dict[str, object] = {}
        for field in dataclasses.fields(last):
            value = getattr(last, field.name)
            if not isinstance(value, Affine):
                continue
            if field.name.endswith("_seconds"):
                changes[field.name] = _scaled(value, ratio)
            else:
                changes[field.name] = self._affine(
                    f"{path}.{field.name}", [getattr(i, field.name) for i in items], s
                )
        return dataclasses.replace(last, **changes)  # type: ignore[arg-type]

    def _segment(self, path: str, items: Sequence[Segment], s: int) -> Segment:
        last = items[-1]
        changes = {}
        for kind in ("points", "ckpt_points", "selective_points"):
            lists = [getattr(seg, kind) for seg in items]
            if not lists[-1]:
                continue
            points = [
                self.pair(
                    f"{path}.{kind}[{i}]",
                    [pts[i][0] for pts in lists],
                    [pts[i][1] for pts in lists],
                    s,
                )
                for i in range(len(lists[-1]))
            ]
            changes[kind] = tuple(points[i] for i in undominated_vectors(points))
        return dataclasses.replace(last, **changes)  # type: ignore[arg-type]


def _scaled(seconds: Affine, ratio: float) -> Affine:
    """A time at the longest probed length with its per-sample part scaled by ``ratio``."""
    return Affine(
        intercept=seconds.intercept, slope=seconds.slope * ratio, residual=seconds.residual
    )


def profile_at(profile: Profile, seq_len: int) -> Profile:
    """``profile`` evaluated at ``seq_len`` tokens per sample (see SeqModel)."""
    return SeqModel(profile).at(seq_len)


# ------------------------------------------------------------------------------ the grid
def grid_profile(seq_lens: Sequence[int], profiles: Sequence[Profile]) -> Profile:
    """One profile from probes at ``seq_lens`` (made with every timeline point kept, in op
    order): the longest length's own numbers, with ``seq`` holding all of them, their
    points pruned together. CannotMeasureError when the layers or the layer boundaries
    differ between lengths (the points would not correspond)."""
    from memplan.errors import CannotMeasureError
    from memplan.profile import SeqGrid

    lens = tuple(seq_lens)
    first, last = profiles[0], profiles[-1]
    for s, p in zip(lens, profiles, strict=True):
        same = (
            p.layer_names == first.layer_names
            and [f.name for f in p.fixed] == [f.name for f in first.fixed]
            and all(
                [(g.held, g.active) for g in p.timeline[phase]]
                == [(g.held, g.active) for g in first.timeline[phase]]
                for phase in first.timeline
            )
        )
        if not same:
            raise CannotMeasureError(
                f"{first.model.spec}: the layers or layer boundaries at length {s} differ "
                f"from those at {lens[0]}, so the lengths cannot be fitted together.",
                hint="Probe lengths at which the model runs the same layers (the same "
                "attention path), or plan each length from its own probe.",
            )
    warnings = list(last.warnings)
    mismatched: list[str] = []
    pruned = [dict(p.timeline) for p in profiles]
    for phase, segments in first.timeline.items():
        new_segments: list[list[Segment]] = [[] for _ in profiles]
        for k in range(len(segments)):
            per_len = [p.timeline[phase][k] for p in profiles]
            changes: list[dict[str, tuple[Point, ...]]] = [{} for _ in profiles]
            for kind in ("points", "ckpt_points", "selective_points"):
                lists = [getattr(seg, kind) for seg in per_len]
                if not any(lists):
                    continue
                if len({len(x) for x in lists}) != 1:
                    # Different ops at different lengths: one point above all of each.
                    mismatched.append(f"timeline.{phase}[{k}].{kind}")
                    for c, pts in zip(changes, lists, strict=True):
                        c[kind] = ((max(p[0] for p in pts), max(p[1] for p in pts)),) if pts else ()
                    continue
                fits = [
                    fit_pair(lens, [x[i][0] for x in lists], [x[i][1] for x in lists])
                    for i in range(len(lists[0]))
                ]
                vectors = [a.by_power() + b.by_power() for a, b in fits]
                keep = undominated_vectors(vectors)
                for c, pts in zip(changes, lists, strict=True):
                    c[kind] = tuple(pts[i] for i in keep)
            for out, seg, c in zip(new_segments, per_len, changes, strict=True):
                out.append(dataclasses.replace(seg, **c))  # type: ignore[arg-type]
        for timeline, segs in zip(pruned, new_segments, strict=True):
            timeline[phase] = tuple(segs)
    inner = tuple(
        dataclasses.replace(p, timeline=t, seq_len=s, seq=None, warnings=())
        for p, t, s in zip(profiles, pruned, lens, strict=True)
    )
    grid = dataclasses.replace(last, seq_len=lens[-1], seq=SeqGrid(seq_lens=lens, profiles=inner))
    model = SeqModel(grid)
    model.at(2 * lens[-1])  # fits every quantity once, so the flags below are complete
    if mismatched:
        warnings.append(
            f"{len(mismatched)} timeline segment(s) ran different ops at different lengths "
            f"({', '.join(mismatched[:3])}): each is bounded by one point above all of its "
            "points; verify plans at their length."
        )
    # Transient peaks are maxima, read by no peak the solver takes: not worth a warning.
    names = [name for name in model.unfit if "transient" not in name]
    if names:
        warnings.append(
            f"{len(names)} quantit{'y' if len(names) == 1 else 'ies'} fit no form in the "
            f"sequence length ({', '.join(names[:4])}{', …' if len(names) > 4 else ''}): "
            "they shrink as the length grows or grow faster than its square; do not trust "
            "extrapolation from them, and probe a third length to check."
        )
    timeline = {
        phase: tuple(_pruned_segment(seg) for seg in segments)
        for phase, segments in last.timeline.items()
    }
    return dataclasses.replace(grid, timeline=timeline, warnings=tuple(dict.fromkeys(warnings)))


def _pruned_segment(seg: Segment) -> Segment:
    changes = {}
    for kind in ("points", "ckpt_points", "selective_points"):
        pts = getattr(seg, kind)
        if pts:
            changes[kind] = tuple(pts[i] for i in undominated_vectors(pts))
    return dataclasses.replace(seg, **changes)  # type: ignore[arg-type]
