"""Where the published 8B runs' step gap lies (bench section ``published``).

memplan's step for a run is a sum over ops, each charged at the rate of its kind: GEMMs
(bf16 and float8) at the device's matmul efficiencies, fused attention at its own, the
memory-bound ops at the memory efficiency. Predicting the same run again with one kind's
rate halved adds what that kind contributes to the step (exactly for the ops bound by that
rate; an op near the roofline's corner adds less). If one kind alone ran slower than memplan
charges it, by a factor ``k``, the step would grow by ``(k - 1)`` times that contribution, so
each run's gap to its published step, divided by each kind's contribution, is the ``k - 1``
that kind would need. A kind that explains the gap needs about the same ``k`` in every run
of one part (same model, layout and batch; eager, compiled and float8): the spread of those
factors is the test. Nothing here is fitted into a prediction: it says where to measure.

Pure arithmetic on the steps; ``bench.published.run`` does the probing and solving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

KINDS: dict[str, tuple[str, ...]] = {
    "GEMMs": ("matmul", "float8_matmul"),
    "attention": ("attention", "attention_backward"),
    "memory-bound ops": ("memory",),
    "NVLink collectives": ("interconnect",),
}
"""Each kind of op, and the device-spec efficiencies (memplan.devices.Efficiency) that set
its rate: halved together in its variant. GEMMs are one kind, bf16 and float8 alike (the
tensor cores' clock is one). NVLink collectives: TP's, CP's and the data-parallel ones
within a node, at NCCL's share of the link (memplan.timing.interconnect_bandwidth); the
data-parallel ones between nodes run at the NICs' rate, which the spec does not set."""

SOLVED_KINDS = frozenset({"NVLink collectives"})
"""Kinds the solver times from the spec it is given, not a probe's meta clock: their
variant is solved again from the same profile (a spec that differs only there keeps the
profile's clock, memplan.devices.spec_digest), with no probe of its own."""


def halved(spec, kind: str):
    """``spec`` with ``kind``'s efficiencies halved (one left unset takes the value the spec
    falls back to: attention's backward its forward's, float8 GEMMs the bf16 ones'), under a
    name of its own: a probe's meta clock is keyed by the spec's name (a ``SOLVED_KINDS``
    variant is not probed: its numbers leave the clock's fingerprint as it was)."""
    efficiency = spec.efficiency
    fallback = {
        "attention_backward": efficiency.backward_attention,
        "float8_matmul": efficiency.matmul
        if efficiency.float8_matmul is None
        else efficiency.float8_matmul,
    }
    values = {field: fallback.get(field, getattr(efficiency, field)) / 2 for field in KINDS[kind]}
    slug = kind.split()[0].lower()
    return dataclasses.replace(
        spec,
        name=f"{spec.name}-half-{slug}",
        display_name=f"{spec.display_name}, {kind} at half rate",
        efficiency=dataclasses.replace(efficiency, **values),
    )


@dataclass(frozen=True)
class Gap:
    """One run: its label, published step, memplan's step and what each kind adds when its
    rate halves (seconds, in ``KINDS`` order)."""

    label: str
    published: float
    predicted: float
    added: tuple[float, ...]

    @property
    def gap(self) -> float:
        return self.published - self.predicted

    def factors(self) -> tuple[float, ...]:
        """``k - 1`` for each kind: the gap over its contribution (inf where it adds none)."""
        return tuple(self.gap / a if a > 0 else float("inf") for a in self.added)


def gap_line(gap: Gap) -> str:
    """A table row: the run, its steps, each kind's contribution and the factor it needs."""
    contributions = " | ".join(f"{a:.2f} s" for a in gap.added)
    factors = " | ".join(f"{f:+.2f}" for f in gap.factors())
    return (
        f"| {gap.label} | {gap.published:.2f} s | {gap.predicted:.2f} s | "
        f"{gap.gap:+.2f} s | {contributions} | {factors} |"
    )


def spread(values: Sequence[float]) -> float:
    """Largest over smallest of positive factors; inf where one is not positive or finite
    (a kind that would have to run faster, or adds nothing, explains no shortfall)."""
    if not values or any(not 0 < v < float("inf") for v in values):
        return float("inf")
    return max(values) / min(values)


def kind_factors(gaps: Sequence[Gap], kind: str) -> list[float]:
    """``kind``'s ``k - 1`` in each of ``gaps``."""
    at = list(KINDS).index(kind)
    return [g.factors()[at] for g in gaps]


def consistency_line(gaps: Sequence[Gap], part: str) -> str:
    """Which kind alone explains the gaps of ``gaps`` (one part's runs, differing in
    technique) most alike: each kind's factors across them, their spread, and the kind
    with the least."""
    per_kind = {name: kind_factors(gaps, name) for name in KINDS}
    spreads = {name: spread(values) for name, values in per_kind.items()}
    best = min(KINDS, key=lambda name: spreads[name])
    cells = "; ".join(
        f"{name} {', '.join(f'{v:+.2f}' for v in values)} (spread "
        + (f"{spreads[name]:.2f}×" if spreads[name] < float("inf") else "none: not all short")
        + ")"
        for name, values in per_kind.items()
    )
    if spreads[best] == float("inf"):
        verdict = "no one kind running slower explains every run's gap"
    else:
        low, high = min(per_kind[best]), max(per_kind[best])
        verdict = (
            f"the kind whose factors agree best is {best} (spread {spreads[best]:.2f}×): "
            f"that kind would have to run {1 + low:.2f}× to {1 + high:.2f}× slower than "
            "memplan charges it"
        )
    return f"On {part} ({len(gaps)} runs), each kind's k − 1: {cells}. So {verdict}."
