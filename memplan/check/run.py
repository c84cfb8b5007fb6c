"""Running the checks: probe each model (in a child process), solve for the target batch
against the budget, compare with the baseline, and return a ``CheckReport``.

A check passes when the solver finds a plan whose predicted peak fits
``budget × (1 − margin)``; its *minimum peak* is the least peak any plan for the target
batch needs (``memplan.solver.least_peak``), so the headroom is
``budget × (1 − margin) − minimum peak`` and "exceeded by" is its negation.

Checks that probe the same model the same way (same file and factory, device, precision,
candidate glob, sizes and device spec) share one probe: the probe does not depend on the
target batch, budget, margin or world size.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from memplan.check.advice import advise
from memplan.check.baseline import check_baseline_target, compare_with_baseline, write_baseline
from memplan.check.config import (
    DEFAULT_CONFIG,
    DEFAULT_TIMEOUT_S,
    CheckConfig,
    CheckSpec,
    ResolvedCheck,
    check_raw_fields,
    load_config,
    resolve_check,
)
from memplan.check.isolate import ProbeRequest, probe_isolated
from memplan.check.result import CheckReport, CheckResult, Growth, PlanSummary, error_exit_code
from memplan.errors import (
    EXIT_BAD_INPUT,
    EXIT_CANNOT_MEASURE,
    EXIT_OK,
    EXIT_OVER_BUDGET,
    BadInputError,
    Interrupted,
    MemplanError,
    NoPlanFitsError,
    first_line,
)
from memplan.files.schema import from_data
from memplan.plan import Plan
from memplan.probe.settings import ProbeSettings
from memplan.profile import Profile
from memplan.solver import LeastPeak, SolveRequest, SolveResult, least_peak, solve

ProbeFn = Callable[[ProbeRequest], Profile]
"""Probes one model; the default runs ``memplan.probe.probe_model`` in a child process."""
SolveFn = Callable[[Profile, SolveRequest], SolveResult]
LeastPeakFn = Callable[[Profile, SolveRequest], LeastPeak]
ProgressFn = Callable[[str, str], None]
PlanFn = Callable[[str, Profile, Plan], None]
"""``on_check(name, what)``: called as each check starts probing and solving."""


def run_checks(
    config: CheckConfig | str | os.PathLike[str] = DEFAULT_CONFIG,
    *,
    only: Sequence[str] | None = None,
    update_baseline: bool = False,
    on_check: ProgressFn | None = None,
    on_plan: PlanFn | None = None,
    probe_fn: ProbeFn = probe_isolated,
    solve_fn: SolveFn = solve,
    least_peak_fn: LeastPeakFn = least_peak,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> CheckReport:
    """Run the checks of ``config`` (a path or a loaded CheckConfig) and return the report.

    ``timeout_s`` limits each probe whose check gives no ``timeout:`` of its own (None: no
    limit); a probe over its limit is an ``error`` naming the phase it was in. A SIGINT or
    SIGTERM (``Interrupted``, ``KeyboardInterrupt``) ends the run early but still returns:
    the finished checks' results, an ``error`` for each unfinished one, and
    ``CheckReport.interrupted`` set to the signal, so that every report is written before
    the caller exits 128 + N. A failure of memplan's own in one check (not a
    ``MemplanError``) is an ``error`` for that check (exit 3), not the end of the run.

    ``only`` selects checks by name (an unknown name is a BadInputError). With
    ``update_baseline`` each check's new profile replaces its baseline file (atomically),
    after the comparison with the old one; every baseline target is checked first
    (``check_baseline_target``), so a bad one stops the run before anything is probed. A
    check whose probe fails becomes an ``error`` result; the other checks still run.
    ``on_plan(name, profile, plan)`` is told each solved check's plan (the closest plan of
    a failing one), for whoever draws them (the step summary's pictures).
    ``probe_fn``, ``solve_fn`` and ``least_peak_fn`` may be replaced (tests do)."""
    if not isinstance(config, CheckConfig):
        config = load_config(config)
    checks = config.checks
    if only:
        names = [c.name for c in checks]
        missing = [name for name in only if name not in names]
        if missing:
            raise BadInputError(
                f"--only {', '.join(missing)}: no such check in {config.path}.",
                hint=f"Checks: {', '.join(names)}.",
            )
        checks = tuple(c for c in checks if c.name in only)
    source = str(config.path)
    if update_baseline:
        for check in checks:
            if check.baseline_path is not None:
                check_baseline_target(check, source)
    probes: dict[ProbeRequest, tuple[Profile | MemplanError, float]] = {}

    def shared_probe(request: ProbeRequest) -> Profile:
        if request not in probes:
            started = time.perf_counter()
            try:
                outcome: Profile | MemplanError = probe_fn(request)
            except MemplanError as exc:
                outcome = exc
            probes[request] = (outcome, time.perf_counter() - started)
        outcome, _ = probes[request]
        if isinstance(outcome, MemplanError):
            raise outcome
        return outcome

    results: list[CheckResult] = []
    interrupted = None
    for c in checks:
        if interrupted is not None:
            results.append(_not_run(c, f"not run: the run was interrupted by signal {interrupted}"))
            continue
        try:
            results.append(
                run_check(
                    c,
                    update_baseline=update_baseline,
                    on_check=on_check,
                    on_plan=on_plan,
                    probe_fn=shared_probe,
                    solve_fn=solve_fn,
                    least_peak_fn=least_peak_fn,
                    source=source,
                    timeout_s=timeout_s,
                )
            )
        except (Interrupted, KeyboardInterrupt) as exc:
            interrupted = exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)
            results.append(_not_run(c, f"interrupted by signal {interrupted} while this check ran"))
        except Exception as exc:  # memplan's own failure: this check's error, not the run's
            text = first_line(exc)[:300]
            results.append(
                _not_run(
                    c,
                    f"memplan failed while running this check: {type(exc).__name__}: {text}",
                    exit_code=EXIT_CANNOT_MEASURE,
                )
            )
    return CheckReport(config=source, results=tuple(results), interrupted=interrupted)


def _base_result(check: ResolvedCheck) -> CheckResult:
    """``check``'s result before it has run: an ``error`` with no message yet."""
    spec = check.spec
    return CheckResult(
        name=spec.name,
        status="error",
        model=spec.model,
        device=spec.device,
        device_profile=spec.device_profile,
        precision=spec.precision,
        target_batch=spec.target_batch,
        world_size=spec.world_size,
        budget_bytes=check.budget_bytes,
        margin=spec.margin,
        baseline=spec.baseline,
    )


def _not_run(check: ResolvedCheck, message: str, *, exit_code: int = EXIT_BAD_INPUT) -> CheckResult:
    return dataclasses.replace(_base_result(check), message=message, exit_code=exit_code)


def probe_request(check: ResolvedCheck, timeout_s: float | None = None) -> ProbeRequest:
    """How ``check`` probes its model: the key under which identical probes are shared
    (its ``timeout:``, else ``timeout_s``, goes along but is not part of the key)."""
    spec = check.spec
    settings = ProbeSettings(
        device=spec.device,
        precision=spec.precision,
        layers=spec.layers,
        device_profile=check.device_profile,
    )
    if spec.micro_batches is not None:
        sizes = tuple(sorted(set(spec.micro_batches)))
        settings = dataclasses.replace(settings, micro_batches=sizes)
    if spec.timing_rounds is not None:
        settings = dataclasses.replace(settings, timing_rounds=spec.timing_rounds)
    return ProbeRequest(
        model_arg=check.model_arg,
        settings=settings,
        seq_len=spec.seq_len,
        timeout_s=spec.timeout if spec.timeout is not None else timeout_s,
    )


def run_check(
    check: ResolvedCheck,
    *,
    update_baseline: bool = False,
    on_check: ProgressFn | None = None,
    on_plan: PlanFn | None = None,
    probe_fn: ProbeFn = probe_isolated,
    solve_fn: SolveFn = solve,
    least_peak_fn: LeastPeakFn = least_peak,
    source: str = DEFAULT_CONFIG,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> CheckResult:
    """Probe, solve and compare one check. Domain errors become an ``error`` result."""
    spec = check.spec
    base = _base_result(check)
    if on_check:
        on_check(spec.name, f"probing on {spec.device}")
    started = time.perf_counter()
    try:
        profile = probe_fn(probe_request(check, timeout_s))
    except MemplanError as exc:
        return dataclasses.replace(
            base,
            message=str(exc),
            exit_code=error_exit_code(exc),
            probe_seconds=time.perf_counter() - started,
        )
    probe_seconds = time.perf_counter() - started
    # Store the model path as memplan.yaml writes it, so a committed baseline does not
    # depend on where the checkout lives.
    profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, path=spec.model)
    )

    if on_check:
        on_check(spec.name, "solving")
    started = time.perf_counter()
    try:
        plan, min_peak, solver_message = _solve(check, profile, solve_fn, least_peak_fn)
    except MemplanError as exc:
        return dataclasses.replace(
            base,
            message=str(exc),
            exit_code=error_exit_code(exc),
            probe_seconds=probe_seconds,
            solve_seconds=time.perf_counter() - started,
        )
    solve_seconds = time.perf_counter() - started
    if on_plan is not None and plan is not None:
        on_plan(spec.name, profile, plan)

    growth: tuple[Growth, ...] = ()
    note = ""
    if check.baseline_path is not None:
        growth, note = compare_with_baseline(check, profile)
    updated = False
    if update_baseline and check.baseline_path is not None:
        try:
            write_baseline(check, profile, source)
        except MemplanError as exc:
            return dataclasses.replace(
                base,
                message=str(exc),
                exit_code=error_exit_code(exc),
                probe_seconds=probe_seconds,
                solve_seconds=solve_seconds,
            )
        updated = True
        note = ""  # the comparison was made; "does not exist yet" is no longer news
    elif update_baseline:
        note = note or "no baseline path in memplan.yaml; nothing written"

    n_layers = len(profile.layers)
    passed = solver_message is None
    result = dataclasses.replace(
        base,
        status="pass" if passed else "fail",
        min_peak_bytes=min_peak,
        plan=_summarise(plan, n_layers),
        baseline_updated=updated,
        baseline_note=note,
        growth=growth,
        message=solver_message or "",
        exit_code=EXIT_OK if passed else EXIT_OVER_BUDGET,
        probe_seconds=probe_seconds,
        solve_seconds=solve_seconds,
    )
    if not passed:
        result = dataclasses.replace(result, advice=advise(result, check, n_layers))
    return result


def solve_request(check: ResolvedCheck) -> SolveRequest:
    return SolveRequest(
        target_batch=check.spec.target_batch,
        budget_bytes=check.budget_bytes,
        world_size=check.spec.world_size,
        margin=check.spec.margin,
        device_spec=check.device_spec,
        model_path=check.spec.model,
        profile_path="",  # probed just now, in memory
    )


def _solve(
    check: ResolvedCheck, profile: Profile, solve_fn: SolveFn, least_peak_fn: LeastPeakFn
) -> tuple[Plan | None, int | None, str | None]:
    """(the plan, or the closest plan when none fits; the least peak any plan needs; None
    when a plan fits, else the solver's message)."""
    request = solve_request(check)
    try:
        plan = solve_fn(profile, request).plan
    except NoPlanFitsError as exc:
        least = None if exc.min_peak_bytes is None else int(exc.min_peak_bytes)
        return exc.closest, least, str(exc)
    return plan, least_peak_fn(profile, request).peak_bytes, None


def _summarise(plan: Plan | None, n_layers: int) -> PlanSummary | None:
    if plan is None:
        return None
    breakdown = plan.predicted.breakdown
    return PlanSummary(
        micro_batch_size=plan.micro_batch_size,
        accumulation_steps=plan.accumulation_steps,
        world_size=plan.world_size,
        checkpoint_layers=tuple(plan.checkpoint_layers),
        n_layers=n_layers,
        checkpoint=tuple((name, plan.checkpoint[name]) for name in plan.checkpoint_layers),
        peak_bytes=int(plan.predicted.peak_bytes),
        step_seconds=float(plan.predicted.step_seconds),
        peak_phase=plan.predicted.peak_phase,
        breakdown=tuple(
            (f.name, int(getattr(breakdown, f.name))) for f in dataclasses.fields(breakdown)
        ),
    )


def check_model(
    model: str,
    *,
    target_batch: int,
    budget: str | int | None = None,
    name: str | None = None,
    **fields: object,
) -> CheckResult:
    """One check without a memplan.yaml: ``fields`` are CheckSpec's (device, device_profile,
    precision, micro_batches, world_size, margin, baseline, layers); relative paths are
    relative to the working directory. The result carries ``probe_seconds`` and
    ``solve_seconds``."""
    raw = {
        "name": name or Path(model).stem,
        "model": model,
        "target_batch": target_batch,
        "budget": budget,
        **fields,
    }
    check_raw_fields(raw, "check_model()", "check")
    spec = from_data(CheckSpec, raw, source="check_model()", path="check")
    return run_check(resolve_check(spec, 0, Path.cwd(), "check_model()"))
