"""A meta probe's clock in bins (memplan.profile.ClockMix): each layer's forward and
backward and the rest of the micro-step, at the smallest and the largest probed size,
from the tracker's mix (``LiveTracker.clock_mix``) as the recorder noted it at each layer's
four times. Another spec re-times the profile from them (memplan.retime)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from memplan.probe.roofline import ClockKey
from memplan.profile import ClockMix, ClockShare

if TYPE_CHECKING:
    from memplan.probe.recorder import LayerRecord, StepRecord
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


def layer_clocks(runs: list[SizeRuns]) -> list[dict[str, tuple[ClockMix, ...]]]:
    """Per layer, its ``fwd_clock``, ``bwd_clock`` and ``selective_clock`` (memplan.profile.
    Layer): its forward's and backward's bins at the end sizes, and what selective
    checkpointing adds to them, as memplan.probe.sizes.mode_seconds times it on meta (the
    layer's forward and backward in the all-selective run less the plain run's, and an
    even share of the change outside the layers, worked out once a size). A clock is empty
    off meta, where a size did not reach both of the phase's times (a layer without a
    backward), or where no selective run was made."""
    ends = _ends(runs)
    outside = {r.size: _outside_change(r) for r in ends}

    def selective(r: SizeRuns, j: int) -> tuple[Mix | None, Mix | None]:
        change, moded = outside[r.size], r.sel_no_grads
        if change is None or moded is None or moded.record is None:
            return None, None
        added = _between(_layer_mix(moded.record.layers[j]), _layer_mix(_record(r).layers[j]))
        return _plus(added, change, 1 / len(_record(r).layers)), moded.clock_mix

    return [
        {
            "fwd_clock": _clock(
                ends, lambda r, j=j: (_phase_mix(_record(r).layers[j], "fwd"), None)
            ),
            "bwd_clock": _clock(
                ends, lambda r, j=j: (_phase_mix(_record(r).layers[j], "bwd"), None)
            ),
            "selective_clock": _clock(ends, lambda r, j=j: selective(r, j)),
        }
        for j in range(len(_record(ends[0]).layers))
    ]


def _record(r: SizeRuns) -> StepRecord:
    record = r.no_grads.record
    assert record is not None
    return record


def _outside_change(r: SizeRuns) -> Mix | None:
    """What the all-selective run changes outside the layers; None without one."""
    moded = r.sel_no_grads
    if moded is None or moded.record is None:
        return None
    return _between(_rest(moded), _rest(r.no_grads))


def _clock(
    ends: list[SizeRuns], mix_at: Callable[[SizeRuns], tuple[Mix | None, Mix | None]]
) -> tuple[ClockMix, ...]:
    """A stretch's bins at each end size, from ``mix_at``'s (mix, the whole it was
    subtracted from or None); empty where an end has no mix."""
    out = []
    for r in ends:
        mix, whole = mix_at(r)
        if mix is None:
            return ()
        out.append(ClockMix(micro_batch=r.size, bins=bins(mix, whole)))
    return tuple(out)


def _phase_mix(layer: LayerRecord, phase: str) -> Mix | None:
    """A layer's forward or backward; None where the step did not reach both its times."""
    start, end = layer.clock.get(f"{phase}_t0"), layer.clock.get(f"{phase}_t1")
    return None if start is None or end is None else _between(end, start)


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
        mix = _phase_mix(layer, phase)
        if mix is not None:
            out = _plus(out, mix)
    return out


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
