"""A meta probe's clock in bins (memplan.profile.ClockMix): each layer's forward and
backward and the rest of the micro-step, at the smallest and the largest probed size,
from the tracker's mix (``LiveTracker.clock_mix``) as the recorder noted it at each layer's
four times. Another spec re-times the profile from them (memplan.retime)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from memplan.probe.roofline import ClockKey
from memplan.profile import ClockMix, ClockShare

if TYPE_CHECKING:
    from memplan.probe.recorder import LayerRecord
    from memplan.probe.session import Run, SizeRuns

Mix = dict[ClockKey, tuple[float, float]]

_NOISE = 1e-9
"""Below this share of the seconds it was subtracted from, a bin's side is rounding."""


def _ends(runs: list[SizeRuns]) -> list[SizeRuns]:
    return [runs[0], runs[-1]] if len(runs) > 1 else list(runs)


def _between(later: Mix, earlier: Mix) -> Mix:
    return {
        key: (c - earlier.get(key, (0.0, 0.0))[0], m - earlier.get(key, (0.0, 0.0))[1])
        for key, (c, m) in later.items()
    }


def bins(mix: Mix, whole: Mix | None = None) -> tuple[ClockShare, ...]:
    """``mix`` as ClockShares (in ``_order``), an empty bin left out. Where ``mix`` is
    what subtracting readings leaves of ``whole`` (the rest of a step, a mode's change), a
    side below a billionth of the whole's seconds is rounding and counts as none: a bin no
    op of the stretch fell in. Empty without a memory rate (not a meta clock)."""
    memory_rate = next((rate for (kind, _, rate, _) in mix if kind == "memory"), 0.0)
    if not memory_rate > 0:
        return ()
    if whole is not None:
        floor = _NOISE * sum(max(c, m) for c, m in whole.values())
        mix = {k: (c if c > floor else 0.0, m if m > floor else 0.0) for k, (c, m) in mix.items()}
    shares = [
        ClockShare(
            kind=kind,  # type: ignore[arg-type]
            peak=peak,  # type: ignore[arg-type]
            flop_rate=0.0 if kind == "memory" else rate,
            memory_rate=memory_rate,
            compute=max(c, 0.0),
            memory=max(m, 0.0),
        )
        for (kind, peak, rate, _), (c, m) in mix.items()
        if max(c, m) > 0
    ]
    return tuple(sorted(shares, key=_order))


def _order(share: ClockShare) -> tuple:
    """Bins in an order their seconds do not decide (two probes of one stretch list them
    alike, which the probe's extrapolation compares): by kind, peak, rate, then their
    FLOPs' seconds over their bytes', which bins of one kind keep 2^(1/4) apart."""
    ratio = share.compute / share.memory if share.memory else float("inf")
    return (share.kind, share.peak or "", share.flop_rate, ratio)


def layer_clock(runs: list[SizeRuns], j: int, phase: Literal["fwd", "bwd"]) -> tuple[ClockMix, ...]:
    """Layer ``j``'s forward or backward in bins at the end sizes; empty off meta or where
    a size did not reach both of the phase's times (a layer without a backward)."""
    out = []
    for r in _ends(runs):
        record = r.no_grads.record
        assert record is not None
        noted = record.layers[j].clock
        start, end = noted.get(f"{phase}_t0"), noted.get(f"{phase}_t1")
        if start is None or end is None:
            return ()
        out.append(ClockMix(micro_batch=r.size, bins=bins(_between(end, start))))
    return tuple(out)


def _plus(a: Mix, b: Mix, scale: float = 1.0) -> Mix:
    out = dict(a)
    for key, (c, m) in b.items():
        c0, m0 = out.get(key, (0.0, 0.0))
        out[key] = (c0 + scale * c, m0 + scale * m)
    return out


def _layer_mix(layer: LayerRecord) -> Mix:
    """A layer's forward and backward together, as far as they ran."""
    out: Mix = {}
    for phase in ("fwd", "bwd"):
        start, end = layer.clock.get(f"{phase}_t0"), layer.clock.get(f"{phase}_t1")
        if start is not None and end is not None:
            out = _plus(out, _between(end, start))
    return out


def selective_clock(runs: list[SizeRuns], j: int) -> tuple[ClockMix, ...]:
    """What selective checkpointing adds to layer ``j``'s micro-step, in bins at the end
    sizes, as memplan.probe.sizes.mode_seconds times it on meta: the layer's forward and
    backward in the all-selective run less the plain run's, and an even share of the
    change outside the layers. Empty where no selective run was made."""
    out = []
    for r in _ends(runs):
        plain, moded = r.no_grads, r.sel_no_grads
        if moded is None or plain.record is None or moded.record is None:
            return ()
        n = len(plain.record.layers)
        added = _between(_layer_mix(moded.record.layers[j]), _layer_mix(plain.record.layers[j]))
        outside = _between(_rest(moded), _rest(plain))
        change = _plus(added, outside, 1 / n)
        out.append(ClockMix(micro_batch=r.size, bins=bins(change, moded.clock_mix)))
    return tuple(out)


def _rest(run: Run) -> Mix:
    """The step's mix outside its layers."""
    assert run.record is not None
    rest = dict(run.clock_mix)
    for layer in run.record.layers:
        rest = _between(rest, _layer_mix(layer))
    return rest


def fixed_clock(runs: list[SizeRuns]) -> tuple[ClockMix, ...]:
    """The micro-step outside the layers in bins at the end sizes: the whole step's less
    each layer's forward and backward; empty off meta."""
    out = []
    for r in _ends(runs):
        if not r.no_grads.clock_mix:
            return ()
        rest = _rest(r.no_grads)
        out.append(ClockMix(micro_batch=r.size, bins=bins(rest, r.no_grads.clock_mix)))
    return tuple(out)
