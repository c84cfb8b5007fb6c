"""One request solved on several profiles of one model, probed different ways (``probe
--precision bf16`` and ``--precision float8``): the plan is the fastest that fits. No torch.

``memplan solve PROFILE --compare OTHER`` (issue 34): each profile is solved with the same
request (budget, batch, world size, layout, strategy, checkpoint constraints), and the
plan is the one of least predicted step time among those that fit; ties go to the first
(the main profile). A profile with no plan that fits is a row saying why; when none fits,
the main profile's no-fit error stands.

The step times are compared as they are, so they must be on one footing: the same model
(its file's digest and factory, its checkpoint candidates), the same sequence length, and
one timing basis — the same device measured, or the same spec timed by the meta clock or by
roofline. A roofline from FLOPs (``memplan.timing``) times every matmul at the profile's
compute dtype, so a float8 profile re-timed that way would lose what float8 buys: it is
refused too (probe both against the spec planned for).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan import retime
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.files.schema import to_data
from memplan.profile import Profile
from memplan.solver.entry import solve
from memplan.solver.request import SolveRequest, SolveResult
from memplan.units import format_bytes, format_seconds

_WHAT_TO_DO = (
    "Compare profiles of one model file probed different ways, e.g. `memplan probe MODEL "
    "--precision bf16 -o bf16.yaml` and `memplan probe MODEL --precision float8 -o "
    "float8.yaml`, on the same device (or against the same --device-profile on meta)."
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Compared:
    """One profile of the comparison and its answer to the request."""

    path: str
    """The profile file, as given."""
    precision: str
    """How it was probed (:func:`precision_label`): ``bf16``, ``float8 tensorwise``, ..."""
    result: SolveResult | None
    """Its plan (reasons of the comparison added to the chosen one's); None: no plan fits."""
    no_fit: NoPlanFitsError | None = None
    """Why no plan fits (the least peak any plan needs); None when one fits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    rows: tuple[Compared, ...]
    """The main profile first, then the compared ones in the order given."""
    chosen: int | None
    """Index in ``rows`` of the fastest that fits (ties: the first); None: none fits."""

    @property
    def result(self) -> SolveResult | None:
        """The chosen profile's result (its plan is the one written); None: none fits."""
        return None if self.chosen is None else self.rows[self.chosen].result


def precision_label(profile: Profile) -> str:
    """How a profile's step ran: its compute dtype, or ``float8 <recipe>`` (the linears in
    torchao's float8, the rest in the compute dtype); `` compiled`` after it when its clock
    was torch.compile's (``probe --compiled``)."""
    env = profile.environment
    label = f"float8 {env.float8.recipe}" if env.float8 is not None else env.precision
    return f"{label} compiled" if env.compiled else label


def timing_basis(profile: Profile, request: SolveRequest) -> str:
    """What the profile's step times under ``request`` are measured or computed on: two
    profiles' times compare only on one basis."""
    source, _ = retime.choose_timing_source(profile, request.device_spec, request.timing)
    env = profile.environment
    if source == "roofline":
        assert request.device_spec is not None  # roofline needs a spec
        return f"roofline from FLOPs against {request.device_spec.name}"
    if source == "rescaled":  # the clock the spec would give (memplan.retime)
        assert request.device_spec is not None
        return f"meta clock against {request.device_spec.name}"
    if env.device == "meta":
        return f"meta clock against {env.device_profile or 'no device spec'}"
    return f"measured on {env.device_name or env.device}"


def same_file_problem(main_path: str, paths: Sequence[str]) -> BadInputError | None:
    """A file among ``paths`` named twice, or the main PROFILE (``main_path``) again,
    however the path is spelled, as the error to raise; None when each is its own file.
    Asked before any compared profile is read (``memplan solve --compare``)."""
    seen = {Path(main_path).resolve(): f"the main PROFILE ({main_path})"}
    for path in paths:
        key = Path(path).resolve()
        if key in seen:
            return BadInputError(
                f"{path} is the same file as {seen[key]}: a profile is compared with itself.",
                hint="Give --compare each other profile of the model once (probed another "
                "way, e.g. `memplan probe MODEL --precision float8 -o float8.yaml`).",
            )
        seen[key] = f"--compare {path}"
    return None


def comparison_problem(
    main: Profile, main_path: str, other: Profile, other_path: str, request: SolveRequest
) -> BadInputError | None:
    """Why ``other`` (file ``other_path``) cannot be compared with ``main`` under
    ``request``, as the error to raise; None when it can."""
    mine, theirs = main.model, other.model
    same_file = mine.sha256 == theirs.sha256 if mine.sha256 and theirs.sha256 else None
    if same_file is None:
        same_file = mine.path == theirs.path
    if not same_file or mine.factory != theirs.factory:
        digest = f" (sha256 {theirs.sha256[:12]}…)" if theirs.sha256 else ""
        ours = f" (sha256 {mine.sha256[:12]}…)" if mine.sha256 else ""
        return BadInputError(
            f"{other_path} profiles another model: {theirs.spec}{digest}, where {main_path} "
            f"profiles {mine.spec}{ours}; their plans do not answer one question.",
            hint="Probe both from the same model file (again, if it changed in between). "
            + _WHAT_TO_DO,
        )
    if other.layer_names != main.layer_names:
        first = next(
            (
                f"{a!r} where {main_path} has {b!r}"
                for a, b in zip(other.layer_names, main.layer_names, strict=False)
                if a != b
            ),
            f"{len(other.layer_names)} layers where {main_path} has {len(main.layer_names)}",
        )
        return BadInputError(
            f"{other_path} has other checkpoint candidates than {main_path}: {first}.",
            hint="Probe both with the same --layers. " + _WHAT_TO_DO,
        )
    if other.seq_len != main.seq_len:
        return BadInputError(
            f"{other_path} was probed at seq_len {other.seq_len}, {main_path} at "
            f"{main.seq_len}: their step times are for samples of different lengths.",
            hint="Probe both at the same sequence length. " + _WHAT_TO_DO,
        )
    basis, main_basis = timing_basis(other, request), timing_basis(main, request)
    if basis != main_basis:
        return BadInputError(
            f"{other_path}'s step times are {basis}, {main_path}'s {main_basis}: the times "
            "are not comparable.",
            hint="Probe both on the same device, or both on meta with the same "
            "--device-profile (the one solve plans for). " + _WHAT_TO_DO,
        )
    retimed = basis.startswith("roofline")
    if retimed and precision_label(other) != precision_label(main):
        return BadInputError(
            f"{other_path} ({precision_label(other)}) and {main_path} "
            f"({precision_label(main)}) would both be timed {basis} (their meta probes were "
            "timed against another spec), and that roofline times every matmul at the "
            "compute dtype, so it cannot tell their precisions apart.",
            hint="Probe both on meta with --device-profile set to the spec solve plans for "
            "(the meta clock times float8 matmuls at the spec's float8 rate).",
        )
    return None


def solve_compared(profiles: Sequence[tuple[str, Profile]], request: SolveRequest) -> Comparison:
    """``request`` solved on each ``(path, profile)`` (the main one first): every row, and
    the fastest that fits chosen (ties: the first). Raises BadInputError (exit 2) naming the
    file for a profile that cannot be compared with the main one, or a request a compared
    profile cannot answer; never NoPlanFitsError (a row carries it: ``Comparison.chosen``
    is None when none fits)."""
    if not profiles:
        raise ValueError("solve_compared needs at least one profile")
    if request.seq_len == "max":
        raise BadInputError(
            "--seq-len max cannot be compared: each profile would answer at its own longest "
            "length, and step times at different lengths do not compare.",
            hint="Compare at a fixed --seq-len N.",
        )
    main_path, main = profiles[0]
    if problem := same_file_problem(main_path, [path for path, _ in profiles[1:]]):
        raise problem
    for path, other in profiles[1:]:
        if problem := comparison_problem(main, main_path, other, path, request):
            raise problem
    rows = [
        _solve_one(path, profile, request, main=index == 0)
        for index, (path, profile) in enumerate(profiles)
    ]
    fitting = [i for i, row in enumerate(rows) if row.result is not None]
    if not fitting:
        return Comparison(rows=tuple(rows), chosen=None)
    chosen = min(fitting, key=lambda i: (_step_seconds(rows[i]), i))
    line = _reason(rows, chosen)
    best = rows[chosen].result
    assert best is not None
    plan = dataclasses.replace(best.plan, reasons=(*best.plan.reasons, line))
    rows[chosen] = dataclasses.replace(rows[chosen], result=dataclasses.replace(best, plan=plan))
    return Comparison(rows=tuple(rows), chosen=chosen)


def _solve_one(path: str, profile: Profile, request: SolveRequest, *, main: bool) -> Compared:
    label = precision_label(profile)
    try:
        result = solve(profile, dataclasses.replace(request, profile_path=path))
    except NoPlanFitsError as exc:
        return Compared(path=path, precision=label, result=None, no_fit=exc)
    except BadInputError as exc:
        if main:
            raise
        raise BadInputError(f"{path} (--compare): {exc.message}", hint=exc.hint) from exc
    return Compared(path=path, precision=label, result=result)


def _step_seconds(row: Compared) -> float:
    assert row.result is not None
    return row.result.plan.predicted.step_seconds


def _reason(rows: Sequence[Compared], chosen: int) -> str:
    """The chosen plan's reason: every profile's figures, against the chosen one's."""
    best = rows[chosen]
    best_seconds = _step_seconds(best)
    assert best.result is not None
    others = []
    for index, row in enumerate(rows):
        if index == chosen:
            continue
        if row.result is None:
            least = row.no_fit.min_peak_bytes if row.no_fit else None
            needs = f": needs {format_bytes(least)} at the least" if least is not None else ""
            others.append(f"{row.precision} ({row.path}) has no plan that fits{needs}")
            continue
        seconds = _step_seconds(row)
        others.append(
            f"{row.precision} ({row.path}) {format_seconds(seconds)} a step "
            f"({_ratio_text(seconds, best_seconds)}), peak "
            f"{format_bytes(row.result.plan.predicted.peak_bytes)}"
        )
    return (
        f"{best.precision} ({best.path}) is the fastest of {len(rows)} profiles solved alike "
        f"(--compare): {format_seconds(best_seconds)} a step, peak "
        f"{format_bytes(best.result.plan.predicted.peak_bytes)}; " + "; ".join(others)
    )


def _ratio_text(seconds: float, best_seconds: float) -> str:
    if best_seconds <= 0:
        return "the chosen one takes no time"
    ratio = seconds / best_seconds
    return "as fast" if ratio == 1 else f"{ratio:.2f}× the chosen one's time"


def comparison_rows(comparison: Comparison) -> list[dict[str, Any]]:
    """One plain dict per profile, as ``--json`` prints it: precision, layout,
    micro-batch × accumulation, checkpointed layers, peak, step time, whether it fits,
    and its step time over the chosen one's."""
    chosen = comparison.result
    chosen_seconds = None if chosen is None else chosen.plan.predicted.step_seconds
    out = []
    for index, row in enumerate(comparison.rows):
        entry: dict[str, Any] = {
            "profile": row.path,
            "precision": row.precision,
            "chosen": index == comparison.chosen,
            "fits": row.result is not None,
        }
        plan = row.result.plan if row.result is not None else None
        if plan is None and row.no_fit is not None:
            plan = row.no_fit.closest
            entry["min_peak_bytes"] = row.no_fit.min_peak_bytes
            entry["why"] = row.no_fit.message
        if plan is not None:
            entry.update(
                strategy=plan.strategy,
                world_size=plan.world_size,
                parallel=to_data(plan.parallel) if plan.parallel is not None else None,
                micro_batch=plan.micro_batch_size,
                accumulation_steps=plan.accumulation_steps,
                grad_sync=plan.grad_sync,
                checkpoint=dict(plan.checkpoint),
                peak_bytes=plan.predicted.peak_bytes,
                step_seconds=plan.predicted.step_seconds,
            )
        fits = row.result is not None and chosen_seconds
        entry["time_vs_chosen"] = (
            plan.predicted.step_seconds / chosen_seconds if fits and plan is not None else None
        )
        out.append(entry)
    return out
