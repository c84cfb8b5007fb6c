"""``memplan report``: where the peak is, drawn. A page (self-contained HTML) or a PNG of
the predicted live-memory timeline of one optimizer step, the candidates behind a plan, the
per-layer choices, and (from ``memplan verify --report``) the measured timeline over them.

``data`` computes everything (pure, no torch); ``draw`` is the only place matplotlib is
imported, lazily; ``page`` writes the HTML. This module loads inputs and writes files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memplan.devices import DeviceSpec, load_device
from memplan.errors import BadInputError, CannotMeasureError, MemplanError, NoPlanFitsError
from memplan.files.schema import load_yaml_file
from memplan.plan import Plan, plan_from_data
from memplan.profile import Profile, load_profile, profile_from_data
from memplan.report.data import (
    MeasuredTimeline,
    Report,
    Timeline,
    TimelineBar,
    coarser,
    plan_only_report,
    plan_report,
    predicted_timeline,
    profile_report,
)
from memplan.units import format_bytes

__all__ = [
    "CheckPlots",
    "MeasuredTimeline",
    "Report",
    "Timeline",
    "TimelineBar",
    "build_report",
    "device_spec_for_plan",
    "measured_timeline",
    "plan_candidates",
    "predicted_timeline",
    "render_report",
    "report_for_plan",
    "summary_markdown",
    "write_report",
    "write_verify_report",
]

REPORT_SUFFIXES = (".html", ".htm", ".png")
MAX_HTML_BYTES = 5 * 1024 * 1024
"""The page must stay small enough to mail and to open instantly (issue #14: under 5 MB)."""


def device_spec_for_plan(plan: Plan) -> DeviceSpec | None:
    """The GPU spec a plan was solved for (its ``device`` names one), else None."""
    if plan.device in ("cpu", "cuda", "meta"):
        return None
    try:
        return load_device(plan.device)
    except BadInputError:
        return None


def plan_candidates(profile: Profile, plan: Plan, device_spec: DeviceSpec | None):
    """The solver's candidates table for the plan's request (target batch, budget, margin,
    ranks, strategy), solved again from ``profile``, and a note when that differs from the
    plan (constraints such as --always-checkpoint are not stored in a plan)."""
    from memplan.solver import SolveRequest, solve
    from memplan.solver.request import BN_MIN_MICRO

    request = SolveRequest(
        target_batch=plan.target_batch,
        budget_bytes=plan.budget_bytes,
        world_size=plan.world_size,
        strategy=plan.strategy,
        margin=plan.margin,
        device_spec=device_spec,
        profile_path=plan.profile,
        # the plan ran its own micro-batch, below BatchNorm's floor if it was allowed to
        # (--allow-small-bn-micro, --bn-min-micro): before, the candidates were refused and
        # the report named flags it does not take
        bn_min_micro=min(BN_MIN_MICRO, plan.micro_batch_size),
    )
    try:
        result = solve(profile, request)
    except NoPlanFitsError as exc:
        return (), [f"No candidate fits the plan's budget any more: {exc}"]
    except BadInputError as exc:
        return (), [f"The candidates could not be solved again: {exc}"]
    chosen = result.plan
    notes = []
    if (chosen.micro_batch_size, chosen.accumulation_steps, set(chosen.checkpoint_layers)) != (
        plan.micro_batch_size,
        plan.accumulation_steps,
        set(plan.checkpoint_layers),
    ):
        # Highlight the plan's row, not the one an unconstrained solve would choose.
        def relabel(c: Any) -> Any:
            mine = (c.micro_batch, c.strategy) == (plan.micro_batch_size, plan.strategy)
            note = "the plan's choice" if mine else c.note
            if c.chosen:
                note = "fastest without the plan's constraints"
            return dataclasses.replace(c, chosen=mine, note=note)

        rows = tuple(relabel(c) for c in result.candidates)
        notes.append(
            f"Solved again from this profile, the choice is micro-batch "
            f"{chosen.micro_batch_size} × {chosen.accumulation_steps} with "
            f"{len(chosen.checkpoint_layers)} checkpointed layers; the plan was solved with "
            "other constraints or another profile. The charts show the plan's choice."
        )
        return rows, notes
    return result.candidates, notes


def plan_profile(plan: Plan, plan_path: Path) -> tuple[Path, Profile] | None:
    """The profile ``plan`` was solved from and where it is, found as ``memplan report``
    finds it (named, or beside the plan) and read once for every note that compares with
    it; None when it is not found or not readable (nothing to compare)."""
    try:
        found = _resolve_profile_path(plan, plan_path, None)
        return found, load_profile(found)
    except (MemplanError, OSError):
        return None


def refuse_another_models_profile(plan: Plan, profile: Profile, where: Path) -> None:
    """BadInputError when ``profile`` is not of the model the plan records (its checkpoint
    candidates differ): ``report`` drew the GPT example's plan over the MLP's profile, exit
    0, with a note blaming a changed profile, where ``verify`` refuses the pairing."""
    recorded = plan.model_fingerprint
    if recorded is None or tuple(recorded.candidate_layers) == profile.layer_names:
        return

    def listed(names: Sequence[str]) -> str:
        return ", ".join(names[:3]) + (", …" if len(names) > 3 else "")

    raise BadInputError(
        f"{where} is the profile of another model than the plan's: the plan was solved for "
        f"{len(recorded.candidate_layers)} checkpoint candidates "
        f"({listed(recorded.candidate_layers)}), the profile has {len(profile.layer_names)} "
        f"({listed(profile.layer_names)}).",
        hint="Pass the profile the plan was solved from with --profile, or solve this "
        "profile for a plan of its own.",
    )


def stale_plan_note(plan: Plan, plan_path: Path, profile_at: tuple[Path, Profile] | None) -> str:
    """A warning when the plan's predicted peak is not what its profile (``plan_profile``)
    gives for the plan's own micro-batch, accumulation and modes: a plan edited by hand
    from 16 × 2 to 8 × 4 kept "74.4 MiB" (the profile gives 47.4 MiB), which ``show``
    printed and ``verify`` compared with, as memplan's misprediction. '' when they agree, or
    when there is no profile or it is another model's (nothing to compare)."""
    if profile_at is None:
        return ""
    found, profile = profile_at
    env = profile.environment
    said, probed = (plan.precision, plan.mixed_precision), (env.precision, env.mixed_precision)
    if said != probed:  # solve copies both from the profile: the plan was edited
        return (
            f"{plan_path} says precision {_precision(*said)}, and its profile ({found}) was "
            f"probed in {_precision(*probed)}: the plan was edited by hand, or solved from "
            "another profile. Its numbers are the profile's precision's; probe the model "
            f"with --precision {plan.precision} and solve that profile for a plan in it."
        )
    try:
        refuse_another_models_profile(plan, profile, found)
        peak = report_for_plan(plan, profile, candidates=False).timeline.peak_bytes
    except (MemplanError, OSError):
        return ""
    if peak == plan.predicted.peak_bytes:
        return ""
    return (
        f"{plan_path} says a peak of {format_bytes(plan.predicted.peak_bytes)}, and its "
        f"profile ({found}) predicts {format_bytes(peak)} for micro-batch "
        f"{plan.micro_batch_size} × {plan.accumulation_steps} with these layers: the plan was "
        "edited by hand, or the profile changed since it was solved. Solve again for a plan "
        "that says what its profile predicts."
    )


def _precision(precision: str, mixed: str) -> str:
    return precision if precision == "fp32" else f"{precision} ({mixed})"


def _resolve_profile_path(plan: Plan, plan_path: Path, override: Path | None) -> Path:
    if override is not None:
        return override
    if not plan.profile:
        raise BadInputError(
            f"{plan_path} does not name the profile it was solved from.",
            hint="Pass it with --profile PROFILE.",
        )
    named = Path(plan.profile)
    for candidate in (named, plan_path.parent / named, plan_path.parent / named.name):
        if candidate.is_file():
            return candidate
    raise BadInputError(
        f"{plan_path} was solved from {plan.profile}, which is not found (looked in the "
        f"current folder and beside the plan).",
        hint="Pass the profile with --profile PROFILE.",
    )


def report_for_plan(
    plan: Plan,
    profile: Profile,
    *,
    measured: MeasuredTimeline | None = None,
    candidates: bool = True,
) -> Report:
    spec = device_spec_for_plan(plan)
    profile = _at_plans_length(plan, profile)
    if plan.parallel is not None:
        return _layout_report(plan, profile, spec, measured)
    rows, notes = plan_candidates(profile, plan, spec) if candidates else ((), [])
    return plan_report(
        profile, plan, device_spec=spec, candidates=rows, measured=measured, notes=notes
    )


def _at_plans_length(plan: Plan, profile: Profile) -> Profile:
    """``profile`` at the plan's sequence length, as the solver evaluated it
    (``profile.seqlen.profile_at``): before, a plan solved with ``--seq-len``,
    ``--seq-len max`` or ``--tokens-per-batch`` was drawn (and checked by show and verify)
    at the probed length, 16.3 MiB for a plan of 30.1 MiB, and called edited by hand."""
    if plan.seq_len is None or (profile.seq is None and profile.seq_len == plan.seq_len):
        return profile
    if profile.seq is None:
        probed = profile.seq_len or "the model file's own length"
        raise BadInputError(
            f"the plan is for {plan.seq_len} tokens per sample, and its profile was probed "
            f"at {probed} alone, so it cannot say the plan's figures.",
            hint="Pass the profile the plan was solved from with --profile PROFILE.",
        )
    from memplan.profile.seqlen import profile_at

    return profile_at(profile, plan.seq_len)


def _layout_report(
    plan: Plan, profile: Profile, spec: DeviceSpec | None, measured: MeasuredTimeline | None
) -> Report:
    """A plan with a parallel layout, as the layout search solved it: one rank of its worst
    pipeline stage (the rank the plan's predicted peak is of), under the layout's sharding;
    no candidates table (the layout search's table is ``memplan solve --json``'s
    ``layouts``), never a data-parallel solve of the whole model."""
    from memplan.memory.parallel import layout_peaks, layout_sharding, rank_profile

    layout = plan.parallel
    assert layout is not None
    worst = layout_peaks(profile, plan, spec).worst
    from memplan.solver.tp_gemms import gemm_spec, rank_gemms_profile

    rank = rank_profile(profile, layout, worst.stage, plan.accumulation_steps)
    rank = rank_gemms_profile(rank, layout, gemm_spec(profile, spec))  # as the solve timed it
    where = (
        f"pipeline stage {worst.stage} of {layout.pp} (its highest peak), " if layout.pp > 1 else ""
    )
    note = (
        f"Layout {layout.describe()}: the charts show one rank of {where}"
        f"{len(rank.layers)} of the model's {len(profile.layers)} blocks."
    )
    return plan_report(
        rank,
        plan,
        device_spec=spec,
        measured=measured,
        notes=[note],
        sharding=layout_sharding(plan.strategy, layout, plan.grad_sync),
    )


def build_report(
    path: Path,
    *,
    profile_path: Path | None = None,
    target_batch: int | None = None,
    budget: str | None = None,
    device_profile: str | None = None,
) -> Report:
    """A report from a plan (and the profile it names) or from a profile: with
    ``target_batch`` and ``budget`` the profile is solved first, else it is shown alone."""
    data = load_yaml_file(path, what="profile or plan")
    if "target_batch" in data:
        given = [
            flag
            for flag, value in (
                ("--target-batch", target_batch),
                ("--budget", budget),
                ("--device-profile", device_profile),
            )
            if value is not None
        ]
        if given:  # (before, silently ignored: the page showed the plan's own)
            raise BadInputError(
                f"{path} is a plan, drawn as it was solved; {', '.join(given)} "
                f"{'solves' if len(given) == 1 else 'solve'} a profile.",
                hint=f"Drop {', '.join(given)}, or report the plan's profile with them "
                "(memplan report PROFILE --target-batch N --budget SIZE).",
            )
        plan = plan_from_data(data, source=str(path))
        try:
            found = _resolve_profile_path(plan, path, profile_path)
        except BadInputError as exc:
            if profile_path is not None:
                raise
            # The plan alone still has its peak and breakdown: draw those, say what is missing.
            return plan_only_report(
                plan,
                f"{exc.message} Without it only the peak's breakdown is drawn; {exc.hint}",
            )
        profile = load_profile(found)
        refuse_another_models_profile(plan, profile, found)
        return report_for_plan(plan, profile)
    profile = profile_from_data(data, source=str(path))
    spec = load_device(device_profile) if device_profile else None
    if (target_batch is None) != (budget is None):
        raise BadInputError(
            "--target-batch and --budget go together: give both to report a plan solved "
            "from the profile, or neither to report the profile alone."
        )
    if target_batch is None:
        return profile_report(profile, device_spec=spec)
    from memplan.devices import resolve_budget
    from memplan.solver import SolveRequest, solve

    budget_bytes = resolve_budget(
        budget or "",
        device_spec=spec,
        probed_capacity_bytes=profile.environment.device_capacity_bytes,
    )
    request = SolveRequest(
        target_batch=target_batch,
        budget_bytes=budget_bytes,
        device_spec=spec,
        profile_path=str(path),
    )
    result = solve(profile, request)
    return plan_report(profile, result.plan, device_spec=spec, candidates=result.candidates)


def measured_timeline(result: Any) -> MeasuredTimeline | None:
    """The measured timeline of a verify result (one process, or the rank with the highest
    peak of a multi-rank run), or None when none was recorded."""
    ranks = getattr(result, "ranks", None)
    if ranks:
        source = max(ranks, key=lambda r: r.tracker_peak_bytes)
        label = f"measured, rank {source.rank} of {len(ranks)} (highest peak)"
    else:
        source, label = result, f"measured ({result.device})"
    pieces = source.timeline
    if len(pieces) < 2:
        return None
    return MeasuredTimeline(
        micro_steps=tuple(pieces[:-1]),
        optimizer_step=tuple(pieces[-1]),
        forward_ops=tuple(getattr(source, "timeline_forward_ops", ())),
        label=label,
    )


def write_verify_report(result: Any, plan_path: Path, output: Path, *, force: bool = False) -> int:
    """``memplan verify --report``: the plan's report with the measured timeline drawn over
    the predicted one. ``result`` is a VerifyResult or a DistributedVerifyResult."""
    plan = result.plan
    profile = load_profile(_resolve_profile_path(plan, plan_path, None))
    notes = []
    reserve = plan.predicted.breakdown.reserve
    if reserve and getattr(result, "device", "") != "cuda":
        notes.append(
            f"The run was on {result.device}: the measured line has no CUDA reserve "
            f"({reserve:,} bytes of the predicted bars)."
        )
    report = report_for_plan(plan, profile, measured=measured_timeline(result))
    if notes:
        report = dataclasses.replace(report, notes=(*report.notes, *notes))
    return write_report(report, output, force=force)


SUMMARY_DPI = 60
"""The step summary's PNG is drawn smaller: GitHub caps a step's summary at 1 MiB."""


def summary_markdown(name: str, profile: Profile, plan: Plan) -> str:
    """A markdown section with the report's PNG inline (a base64 data URI), for
    ``$GITHUB_STEP_SUMMARY``; empty when matplotlib is not installed (the summary's text is
    written anyway)."""
    import base64
    import html

    from memplan.check.formats import markdown_text
    from memplan.report import draw

    try:
        draw.matplotlib_pyplot()
    except BadInputError:
        return ""
    report = report_for_plan(plan, profile)
    png = draw.png_bytes(draw.combined_figure(report), dpi=SUMMARY_DPI)
    encoded = base64.b64encode(png).decode("ascii")
    where = report.timeline.bars[report.timeline.peak_index].where
    alt = html.escape(f"{name}: predicted memory over one step, peak during {where}")
    alt = alt.replace("\n", " ").replace("\r", " ")
    return (
        f"\n#### {markdown_text(name)}: where the peak is\n\n"
        f'<img alt="{alt}" src="data:image/png;base64,{encoded}">\n'
    )


class CheckPlots:
    """Keeps each check's profile and plan (a failing check's closest plan), to draw them
    in the GitHub step summary: pass ``keep`` as run_checks's ``on_plan``."""

    def __init__(self) -> None:
        self.plans: dict[str, tuple[Profile, Plan]] = {}

    def keep(self, name: str, profile: Profile, plan: Plan) -> None:
        self.plans.setdefault(name, (profile, plan))

    def append_to(self, path: str | Path) -> int:
        """Append one section per kept check to ``path``; the number of images written."""
        sections = [summary_markdown(name, *kept) for name, kept in self.plans.items()]
        sections = [section for section in sections if section]
        if sections:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write("".join(sections))
        return len(sections)


def render_report(report: Report, suffix: str, *, max_html_bytes: int = MAX_HTML_BYTES) -> bytes:
    """The report as HTML or PNG bytes (``suffix``: .html, .htm or .png). A page over
    ``max_html_bytes`` is drawn again with less detail (``data.coarser``) until it fits."""
    from memplan.report import draw

    if suffix == ".png":
        return draw.png_bytes(draw.combined_figure(report))
    from memplan.report.page import render_html

    while True:
        timeline_svg = draw.svg_text(draw.timeline_figure(report))
        candidates_svg = (
            draw.svg_text(draw.candidates_figure(report)) if report.candidates else None
        )
        page = render_html(report, timeline_svg=timeline_svg, candidates_svg=candidates_svg).encode(
            "utf-8"
        )
        if len(page) <= max_html_bytes:
            return page
        smaller = coarser(report)  # half the bars, or the table's middle rows left out
        if smaller is None:
            raise CannotMeasureError(
                f"memplan report: the page is {len(page):,} bytes with nothing left to "
                f"merge, over its limit of {max_html_bytes:,}.",
                hint="Write -o report.png instead; this is a limit of memplan's, not the model's.",
            )
        report = smaller


def check_output(path: Path, option: str = "-o") -> str:
    """The output's suffix, or a clear error for any other (before any work is done);
    ``option``: the flag that named it (``verify --report``)."""
    suffix = path.suffix.lower()
    if suffix not in REPORT_SUFFIXES:
        raise BadInputError(
            f"{option} {path}: a report is written as .html or .png, not "
            f"{suffix or 'no suffix'!r}.",
            hint=f"For example {option} report.html (a page to open) or {option} report.png "
            "(an image).",
        )
    return suffix


def write_report(report: Report, path: Path, *, force: bool = False) -> int:
    """Render and write atomically (never overwriting without ``force``); the bytes written."""
    from memplan.files.io import write_bytes_atomic

    body = render_report(report, check_output(path))
    write_bytes_atomic(path, body, force=force)
    return len(body)
