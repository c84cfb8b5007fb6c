"""The CI memory-budget gate: does every check in ``memplan.yaml`` still fit its budget?

For each check: probe the model (on ``meta`` or ``cpu`` in CI), solve for the target batch
against the budget, and compare the new profile with a committed baseline profile by layer
name, so a failure can say *what grew*. Everything here returns data (``CheckReport``); the
CLI (``memplan.cli_check``) renders it and turns ``CheckReport.exit_code`` into the exit
status. JSON, JUnit XML and the GitHub step-summary markdown are pure text functions here.

``memplan.yaml``::

    version: 1                      # optional
    checks:
      - name: gpt-finetune-4090     # unique; what --only selects
        model: train/model.py       # relative to memplan.yaml; model.py:factory allowed
        target_batch: 64
        budget: 24GiB               # a size, or N% of device_profile's memory; optional
                                    # with device_profile (then: all of its memory)
        device: meta                # how to probe: meta | cpu | cuda
        device_profile: rtx4090     # optional GPU spec: capacity (for %) and speed (meta)
        precision: bf16             # fp32 | bf16 | fp16
        micro_batches: [1, 2, 4]    # optional: sizes the probe measures
        world_size: 1
        margin: 0.03                # fraction of the budget kept free
        baseline: memplan/baseline/gpt.profile.yaml   # optional committed profile
        layers: "transformer.h.*"   # optional checkpoint-candidate glob for the probe

A check passes when the solver finds a plan whose predicted peak fits
``budget × (1 − margin)``; its *minimum peak* is the least peak any plan for the target
batch needs (what the solver reports when asked to fit into nothing), so the headroom is
``budget × (1 − margin) − minimum peak`` and "exceeded by" is its negation.

Exit codes (``CheckReport.exit_code``): 0 every check passes; 1 a check is over budget;
3 a check could not be measured (the probe's ``CannotMeasureError``); 2 a bad config or a
model file that breaks the contract. When several happen, a check that could not run at
all outranks one that ran and failed: 2 over 3 over 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from memplan.errors import (
    EXIT_BAD_INPUT,
    EXIT_CANNOT_MEASURE,
    EXIT_OK,
    EXIT_OVER_BUDGET,
    BadInputError,
    MemplanError,
    NoPlanFitsError,
)
from memplan.schema import from_data, load_yaml_file
from memplan.units import GiB, KiB, MiB, format_bytes, parse_budget, parse_size

CONFIG_VERSION = 1
DEFAULT_CONFIG = "memplan.yaml"

Status = Literal["pass", "fail", "error"]

# Growth smaller than this is noise (allocator rounding, timing of a meta probe), not news.
GROWTH_MIN_FRACTION = 0.01
GROWTH_MIN_BYTES = 1024


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True, kw_only=True, slots=True)
class CheckSpec:
    """One entry of ``checks:`` in memplan.yaml, as written (sizes still strings)."""

    name: str
    """Unique name; shown in every row and selected by ``--only``."""
    model: str
    """Model file relative to memplan.yaml (``model.py`` or ``model.py:factory``)."""
    target_batch: int
    """Effective batch: micro-batch × accumulation × world_size."""
    budget: str | int | None = None
    """``24GiB``, bytes, or ``80%`` of ``device_profile``'s memory; omitted: all of it."""
    device: Literal["meta", "cpu", "cuda"] = "meta"
    """How to probe: ``meta`` (shapes only, no memory; fast), ``cpu`` or ``cuda``."""
    device_profile: str | None = None
    """GPU spec from profiles/devices/ (e.g. ``rtx4090``): capacity and speed."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    micro_batches: tuple[int, ...] | None = None
    """Micro-batch sizes the probe measures (at least two); default the probe's."""
    world_size: int = 1
    margin: float = 0.03
    """Fraction of the budget kept free."""
    baseline: str | None = None
    """Committed profile (relative to memplan.yaml) to compare a new profile with."""
    layers: str | None = None
    """Glob of checkpoint candidates for the probe (default: the repeated blocks)."""

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("name must not be empty")
        if self.target_batch < 1:
            raise ValueError(f"target_batch must be >= 1, got {self.target_batch}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.target_batch % self.world_size:
            raise ValueError(
                f"target_batch {self.target_batch} is not divisible by world_size {self.world_size}"
            )
        if self.baseline is not None and not self.baseline.strip():
            raise ValueError("baseline must be a path, not empty")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedCheck:
    """A validated check: paths resolved against memplan.yaml, budget in bytes."""

    index: int
    spec: CheckSpec
    model_path: Path
    """The model file, resolved."""
    model_arg: str
    """What the probe gets: the resolved path, with ``:factory`` when one was given."""
    budget_bytes: int
    baseline_path: Path | None
    device_spec: Any = None
    """memplan.devices.DeviceSpec or None."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def field_path(self) -> str:
        return f"checks[{self.index}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig:
    path: Path
    checks: tuple[ResolvedCheck, ...]


def _config_error(
    source: str, field_path: str, problem: str, hint: str | None = None
) -> BadInputError:
    return BadInputError(f"{source}: field '{field_path}' {problem}.", hint=hint)


def load_config(path: str | os.PathLike[str] = DEFAULT_CONFIG) -> CheckConfig:
    """Read and validate memplan.yaml. Every problem is a ``BadInputError`` (exit 2) naming
    the file and the field path (``checks[0].budget``); nothing is probed yet."""
    config_path = Path(path)
    source = str(config_path)
    if not config_path.is_file():
        raise BadInputError(
            f"config file {config_path} does not exist.",
            hint="Write a starter with `memplan init-check model.py`, or pass --config PATH.",
        )
    data = load_yaml_file(config_path, what="memplan.yaml config")
    known = {"version", "checks"}
    unknown = sorted(map(str, set(data) - known))
    if unknown:
        raise _config_error(
            source,
            "(top level)",
            f"has unknown key(s) {', '.join(unknown)}",
            hint=f"Known keys: {', '.join(sorted(known))}.",
        )
    version = data.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise _config_error(
            source,
            "version",
            f"is {version!r}; this memplan reads version {CONFIG_VERSION}",
            hint="Upgrade memplan or fix the version.",
        )
    raw_checks = data.get("checks")
    if not isinstance(raw_checks, list) or not raw_checks:
        raise _config_error(
            source,
            "checks",
            "must be a non-empty list of checks",
            hint="See `memplan init-check --help` or docs/ci.md.",
        )
    base = config_path.resolve().parent
    resolved: list[ResolvedCheck] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_checks):
        spec = from_data(CheckSpec, raw, source=source, path=f"checks[{index}]")
        if spec.name in seen:
            raise _config_error(
                source,
                f"checks[{index}].name",
                f"{spec.name!r} repeats checks[{seen[spec.name]}].name",
                hint="Give each check a unique name.",
            )
        seen[spec.name] = index
        resolved.append(_resolve(spec, index, base, source))
    return CheckConfig(path=config_path, checks=tuple(resolved))


def _resolve(spec: CheckSpec, index: int, base: Path, source: str) -> ResolvedCheck:
    from memplan.devices import load_device
    from memplan.loader import DEFAULT_FACTORY, split_model_arg

    where = f"checks[{index}]"
    path_text, factory = split_model_arg(spec.model)
    model_path = (base / path_text) if not Path(path_text).is_absolute() else Path(path_text)
    if not model_path.is_file():
        raise _config_error(
            source,
            f"{where}.model",
            f"names {spec.model!r}, and {model_path} does not exist",
            hint="Paths are relative to the config file.",
        )
    model_arg = str(model_path) if factory == DEFAULT_FACTORY else f"{model_path}:{factory}"

    device_spec = None
    if spec.device_profile is not None:
        try:
            device_spec = load_device(spec.device_profile)
        except MemplanError as exc:
            raise _config_error(
                source, f"{where}.device_profile", f"is invalid: {exc.message}", hint=exc.hint
            ) from None
    capacity = device_spec.memory_bytes if device_spec is not None else None

    budget = spec.budget
    if budget is None:
        if capacity is None:
            raise _config_error(
                source,
                f"{where}.budget",
                "is missing",
                hint="Give a size (e.g. 24GiB), or a device_profile whose memory is the budget.",
            )
        budget_bytes = int(capacity)
    elif isinstance(budget, str) and budget.strip().lower() == "auto":
        raise _config_error(
            source,
            f"{where}.budget",
            "is 'auto', which depends on the machine that runs the check",
            hint="Write a size such as 24GiB, or a percentage with device_profile.",
        )
    else:
        try:
            budget_bytes = parse_budget(budget, capacity_bytes=capacity, what="budget")
        except BadInputError as exc:
            raise _config_error(
                source, f"{where}.budget", f"is invalid: {exc.message}", hint=exc.hint
            ) from None

    if spec.micro_batches is not None:
        sizes = spec.micro_batches
        if len(set(sizes)) < 2 or min(sizes) < 1:
            raise _config_error(
                source,
                f"{where}.micro_batches",
                f"is {list(sizes)}; it must list at least two distinct positive sizes",
                hint="e.g. [1, 2, 4].",
            )

    baseline_path = None
    if spec.baseline is not None:
        baseline_path = Path(spec.baseline)
        if not baseline_path.is_absolute():
            baseline_path = base / baseline_path
    return ResolvedCheck(
        index=index,
        spec=spec,
        model_path=model_path,
        model_arg=model_arg,
        budget_bytes=budget_bytes,
        baseline_path=baseline_path,
        device_spec=device_spec,
    )


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    """The plan a passing check would use (or the closest plan of a failing one)."""

    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    checkpoint_layers: tuple[str, ...]
    n_layers: int
    """Checkpoint candidates in the profile: ``len(checkpoint_layers)`` of ``n_layers``."""
    peak_bytes: int
    step_seconds: float
    peak_phase: str = ""
    """Where the peak happens, e.g. 'optimizer step', 'backward of blocks.0'."""
    breakdown: tuple[tuple[str, int], ...] = ()
    """Bytes at the peak by what holds them: params, grads, optimizer, activations,
    transient, reserve."""

    @property
    def checkpointed(self) -> int:
        return len(self.checkpoint_layers)


@dataclass(frozen=True, kw_only=True, slots=True)
class Growth:
    """One quantity that differs from the baseline profile."""

    name: str
    """Layer or fixed-part name, ``(total)`` for whole-model totals."""
    kind: Literal["layer", "fixed", "total"]
    quantity: Literal[
        "params_bytes", "activation_bytes_per_sample", "grad_bytes", "optimizer_state_bytes"
    ]
    baseline: float | None
    """None: the layer is new."""
    current: float | None
    """None: the layer is gone."""

    @property
    def delta(self) -> float:
        return (self.current or 0.0) - (self.baseline or 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    name: str
    status: Status
    model: str
    """As written in memplan.yaml."""
    device: str
    device_profile: str | None
    precision: str
    target_batch: int
    world_size: int
    budget_bytes: int
    margin: float
    min_peak_bytes: int | None = None
    """Least predicted peak of any plan for the target batch; None when not measured."""
    plan: PlanSummary | None = None
    """The plan it would use; on failure the closest plan, if the solver gave one."""
    baseline: str | None = None
    baseline_updated: bool = False
    baseline_note: str = ""
    """Why no comparison was made, or what differs in how the baseline was probed."""
    growth: tuple[Growth, ...] = ()
    """What grew (or shrank) since the baseline, largest first."""
    advice: tuple[str, ...] = ()
    message: str = ""
    """The error (status ``error``) or the solver's word on a failure."""
    exit_code: int = EXIT_OK
    probe_seconds: float = 0.0
    solve_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """Probe + solve: what a CI run spends on this check."""
        return self.probe_seconds + self.solve_seconds

    @property
    def usable_budget_bytes(self) -> int:
        return int(self.budget_bytes * (1 - self.margin))

    @property
    def headroom_bytes(self) -> int | None:
        if self.min_peak_bytes is None:
            return None
        return self.usable_budget_bytes - self.min_peak_bytes

    @property
    def exceeded_by_bytes(self) -> int | None:
        headroom = self.headroom_bytes
        return -headroom if headroom is not None and headroom < 0 else None

    @property
    def grown(self) -> tuple[Growth, ...]:
        return tuple(g for g in self.growth if g.delta > 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckReport:
    config: str
    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.status == "pass" for r in self.results)

    @property
    def exit_code(self) -> int:
        codes = {r.exit_code for r in self.results}
        for code in (EXIT_BAD_INPUT, EXIT_CANNOT_MEASURE, EXIT_OVER_BUDGET):
            if code in codes:
                return code
        return EXIT_OK

    def count(self, status: Status) -> int:
        return sum(r.status == status for r in self.results)


# ----------------------------------------------------------------------------- running
ProbeFn = Callable[..., Any]
SolveFn = Callable[[Any, Any], Any]
ProgressFn = Callable[[str, str], None]
"""``on_check(name, what)``: called as each check starts probing and solving."""


def run_checks(
    config: CheckConfig | str | os.PathLike[str] = DEFAULT_CONFIG,
    *,
    only: Sequence[str] | None = None,
    update_baseline: bool = False,
    on_check: ProgressFn | None = None,
    probe_fn: ProbeFn | None = None,
    solve_fn: SolveFn | None = None,
) -> CheckReport:
    """Run the checks of ``config`` (a path or a loaded CheckConfig) and return the report.

    ``only`` selects checks by name (an unknown name is a BadInputError). With
    ``update_baseline`` each check's new profile replaces its baseline file (atomically),
    after the comparison with the old one. A check whose probe fails becomes an ``error``
    result; the other checks still run. ``probe_fn``/``solve_fn`` default to
    ``memplan.probe.probe_model`` and ``memplan.solver.solve`` (tests may pass others)."""
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
    results = [
        run_check(
            c,
            update_baseline=update_baseline,
            on_check=on_check,
            probe_fn=probe_fn,
            solve_fn=solve_fn,
        )
        for c in checks
    ]
    return CheckReport(config=str(config.path), results=tuple(results))


def run_check(
    check: ResolvedCheck,
    *,
    update_baseline: bool = False,
    on_check: ProgressFn | None = None,
    probe_fn: ProbeFn | None = None,
    solve_fn: SolveFn | None = None,
) -> CheckResult:
    """Probe, solve and compare one check. Domain errors become an ``error`` result."""
    spec = check.spec
    common: dict[str, Any] = dict(
        name=spec.name,
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
    if probe_fn is None:  # imported before the clock starts: torch's import is not the check's
        from memplan.probe import probe_model as probe_fn
    if solve_fn is None:
        from memplan.solver import solve as solve_fn
    if on_check:
        on_check(spec.name, f"probing on {spec.device}")
    started = time.perf_counter()
    try:
        kwargs: dict[str, Any] = dict(
            device=spec.device,
            precision=spec.precision,
            layers=spec.layers,
            device_profile=spec.device_profile,
        )
        if spec.micro_batches is not None:
            kwargs["micro_batches"] = tuple(sorted(set(spec.micro_batches)))
        profile = probe_fn(check.model_arg, **kwargs)
    except MemplanError as exc:
        return CheckResult(
            **common,
            status="error",
            message=str(exc),
            exit_code=exc.exit_code,
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
        plan, min_peak, closest, solver_message = _solve(check, profile, solve_fn)
    except MemplanError as exc:
        return CheckResult(
            **common,
            status="error",
            message=str(exc),
            exit_code=exc.exit_code,
            probe_seconds=probe_seconds,
            solve_seconds=time.perf_counter() - started,
        )
    solve_seconds = time.perf_counter() - started

    growth: tuple[Growth, ...] = ()
    note = ""
    if check.baseline_path is not None:
        growth, note = _compare_with_baseline(check, profile)
    updated = False
    if update_baseline and check.baseline_path is not None:
        from memplan.fileio import write_text_atomic
        from memplan.profile import profile_to_yaml

        write_text_atomic(check.baseline_path, profile_to_yaml(profile), force=True)
        updated = True
        note = ""  # the comparison was made; "does not exist yet" is no longer news
    elif update_baseline:
        note = note or "no baseline path in memplan.yaml; nothing written"

    n_layers = len(profile.layers)
    passed = plan is not None
    summary_plan = _summarise(plan if passed else closest, n_layers)
    result = CheckResult(
        **common,
        status="pass" if passed else "fail",
        min_peak_bytes=min_peak,
        plan=summary_plan,
        baseline_updated=updated,
        baseline_note=note,
        growth=growth,
        message=solver_message,
        exit_code=EXIT_OK if passed else EXIT_OVER_BUDGET,
        probe_seconds=probe_seconds,
        solve_seconds=solve_seconds,
    )
    if not passed:
        result = dataclasses.replace(result, advice=advise(result, check, n_layers))
    return result


def _request(check: ResolvedCheck, budget_bytes: int) -> Any:
    from memplan.solver import SolveRequest

    return SolveRequest(
        target_batch=check.spec.target_batch,
        budget_bytes=budget_bytes,
        world_size=check.spec.world_size,
        margin=check.spec.margin,
        device_spec=check.device_spec,
        model_path=check.spec.model,
        profile_path="",  # probed just now, in memory
    )


def _solve(
    check: ResolvedCheck, profile: Any, solve_fn: SolveFn | None
) -> tuple[Any, int | None, Any, str]:
    """(plan or None, minimum peak, closest plan, solver message). The minimum peak comes
    from the solver's NoPlanFitsError: when the budget passes, it is asked once more with a
    budget nothing fits, and reports the least memory any plan needs."""
    if solve_fn is None:
        from memplan.solver import solve as solve_fn
    try:
        result = solve_fn(profile, _request(check, check.budget_bytes))
        plan, closest, message = result.plan, None, ""
    except NoPlanFitsError as exc:
        plan, closest, message = None, exc.closest, str(exc)
        if exc.min_peak_bytes is not None:
            return None, int(exc.min_peak_bytes), closest, message
    try:
        solve_fn(profile, _request(check, _nothing_fits_budget_bytes(check, profile)))
        min_peak = None  # cannot happen with a real solver: no tensor fits in that budget
    except NoPlanFitsError as exc:
        min_peak = None if exc.min_peak_bytes is None else int(exc.min_peak_bytes)
    return plan, min_peak, closest, message


def _nothing_fits_budget_bytes(check: ResolvedCheck, profile: Any) -> int:
    """A budget no plan fits, for asking the solver for its least peak: just enough for the
    CUDA reserve and not one byte of tensors. (Not 1 byte: the solver's search for the
    allocated limit walks byte by byte when the budget is below the reserve.)"""
    from memplan import memory

    reserve = memory.reserve_for(profile, check.device_spec)
    return memory.budget_for_peak_bytes(max(1, reserve.fixed_bytes), check.spec.margin)


def _summarise(plan: Any, n_layers: int) -> PlanSummary | None:
    if plan is None:
        return None
    return PlanSummary(
        micro_batch_size=plan.micro_batch_size,
        accumulation_steps=plan.accumulation_steps,
        world_size=plan.world_size,
        checkpoint_layers=tuple(plan.checkpoint_layers),
        n_layers=n_layers,
        peak_bytes=int(plan.predicted.peak_bytes),
        step_seconds=float(plan.predicted.step_seconds),
        peak_phase=plan.predicted.peak_phase,
        breakdown=tuple(
            (f.name, int(getattr(plan.predicted.breakdown, f.name)))
            for f in dataclasses.fields(plan.predicted.breakdown)
        ),
    )


# ----------------------------------------------------------------------------- baseline diff
def _compare_with_baseline(check: ResolvedCheck, profile: Any) -> tuple[tuple[Growth, ...], str]:
    from memplan.profile import load_profile

    assert check.baseline_path is not None
    if not check.baseline_path.is_file():
        return (), (
            f"baseline {check.spec.baseline} does not exist yet; write it with "
            "`memplan check --update-baseline`"
        )
    try:
        baseline = load_profile(check.baseline_path)
    except MemplanError as exc:
        return (), f"baseline {check.spec.baseline} is unreadable ({exc.message})"
    notes = []
    env_new, env_old = profile.environment, baseline.environment
    for attribute in ("device", "precision"):
        old, new = getattr(env_old, attribute), getattr(env_new, attribute)
        if old != new:
            notes.append(f"baseline was probed with {attribute} {old}, now {new}")
    return diff_profiles(baseline, profile), "; ".join(notes)


def _params_bytes(part: Any) -> int:
    return int(part.params_trainable_bytes + part.params_frozen_bytes)


def diff_profiles(baseline: Any, current: Any) -> tuple[Growth, ...]:
    """What changed from ``baseline`` to ``current`` (two Profiles), matched by layer and
    fixed-part name: parameter bytes and activation bytes per sample (the slope of the
    bytes a part's forward keeps for backward), and the whole-model totals. Changes below
    1% or 1 KiB are dropped as noise; the largest growth comes first."""
    out: list[Growth] = []

    def add(name: str, kind: Any, quantity: Any, old: float | None, new: float | None) -> None:
        if old is None or new is None:
            if (old or new or 0) != 0:
                out.append(
                    Growth(name=name, kind=kind, quantity=quantity, baseline=old, current=new)
                )
            return
        delta = new - old
        if abs(delta) >= max(GROWTH_MIN_BYTES, GROWTH_MIN_FRACTION * abs(old)):
            out.append(Growth(name=name, kind=kind, quantity=quantity, baseline=old, current=new))

    for kind, attr in (("fixed", "fixed"), ("layer", "layers")):
        old_parts = {p.name: p for p in getattr(baseline, attr)}
        new_parts = {p.name: p for p in getattr(current, attr)}
        for name in list(old_parts) + [n for n in new_parts if n not in old_parts]:
            old, new = old_parts.get(name), new_parts.get(name)
            add(
                name,
                kind,
                "params_bytes",
                None if old is None else _params_bytes(old),
                None if new is None else _params_bytes(new),
            )
            add(
                name,
                kind,
                "activation_bytes_per_sample",
                None if old is None else float(old.saved_bytes.slope),
                None if new is None else float(new.saved_bytes.slope),
            )

    def activation_per_sample(profile: Any) -> float:
        return float(sum(p.saved_bytes.slope for p in (*profile.layers, *profile.fixed)))

    old_t, new_t = baseline.totals, current.totals
    add(
        "(total)",
        "total",
        "params_bytes",
        old_t.params_trainable_bytes + old_t.params_frozen_bytes,
        new_t.params_trainable_bytes + new_t.params_frozen_bytes,
    )
    add("(total)", "total", "grad_bytes", old_t.grad_bytes, new_t.grad_bytes)
    add(
        "(total)",
        "total",
        "optimizer_state_bytes",
        old_t.optimizer_state_bytes,
        new_t.optimizer_state_bytes,
    )
    add(
        "(total)",
        "total",
        "activation_bytes_per_sample",
        activation_per_sample(baseline),
        activation_per_sample(current),
    )
    order = {"layer": 0, "fixed": 0, "total": 1}
    out.sort(key=lambda g: (order[g.kind], -g.delta))
    return tuple(out)


# ----------------------------------------------------------------------------- advice
def suggested_budget(min_peak_bytes: int, margin: float) -> str:
    """A round budget that fits ``min_peak_bytes`` after the margin, as memplan.yaml would
    spell it: rounded up to two significant figures in GiB, MiB or KiB (``22GiB``,
    ``2.9MiB``)."""
    need = max(min_peak_bytes, 1) / (1 - margin)
    unit, scale = next(
        ((u, v) for u, v in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)) if need >= v), ("KiB", KiB)
    )
    value = need / scale
    step = 1.0 if value >= 10 else 0.1
    rounded = math.ceil(round(value / step, 9)) * step
    text = f"{rounded:.0f}" if step == 1.0 else f"{rounded:.1f}"
    if parse_size(f"{text}{unit}") * (1 - margin) < min_peak_bytes:  # float rounding
        rounded += step
        text = f"{rounded:.0f}" if step == 1.0 else f"{rounded:.1f}"
    return f"{text}{unit}"


def advise(result: CheckResult, check: ResolvedCheck, n_layers: int) -> tuple[str, ...]:
    """What to do about a failing check, most direct first. The closest plan is the plan of
    least peak, so the advice follows what holds its peak: accumulation and checkpointing
    only help when activations do and the plan has room left to use them."""
    where = f"{check.field_path}.budget"
    tips = []
    if result.min_peak_bytes is not None:
        tips.append(
            f"raise the budget in memplan.yaml: {where}: "
            f"{suggested_budget(result.min_peak_bytes, result.margin)} would fit "
            f"(margin {result.margin:.0%} kept free)"
        )
    else:
        tips.append(f"raise the budget in memplan.yaml ({where})")
    plan = result.plan
    parts = dict(plan.breakdown) if plan is not None else {}
    state = parts.get("params", 0) + parts.get("grads", 0) + parts.get("optimizer", 0)
    batch_bytes = parts.get("activations", 0) + parts.get("transient", 0)
    if plan is None or not parts:
        tips.append("more accumulation (a smaller micro-batch), or checkpoint more layers")
    else:
        tips.append(
            f"the least-peak plan runs micro-batch {plan.micro_batch_size} × "
            f"{plan.accumulation_steps} accumulation, checkpoints {plan.checkpointed} of "
            f"{n_layers} layers and peaks during {plan.peak_phase or 'the step'}: "
            + ", ".join(f"{name} {format_bytes(value)}" for name, value in plan.breakdown if value)
        )
        reserve = parts.get("reserve", 0)
        if reserve > max(state, batch_bytes):
            tips.append(
                f"the CUDA context and allocator reserve ({format_bytes(reserve)}) is most of "
                "the peak; no plan shrinks it. If it is the 512 MiB default, a profile probed "
                "on the GPU (device: cuda) measures the real one"
            )
        elif batch_bytes >= state:
            if plan.micro_batch_size > 1:
                tips.append(
                    f"more accumulation: micro-batch {plan.micro_batch_size} is the "
                    "smallest allowed here; a target_batch with a smaller divisor (or "
                    "a lower BatchNorm floor) allows a smaller one"
                )
            if plan.checkpointed < n_layers:
                tips.append(
                    "checkpoint more: finer checkpoint candidates (`layers:` glob) "
                    "let the solver save more activations"
                )
            else:
                tips.append(
                    f"all {n_layers} candidate layers are checkpointed already; finer "
                    "candidates (`layers:` glob) can save more"
                )
        else:
            tips.append(
                f"the model state (params, grads, optimizer: {format_bytes(state)}) "
                "holds most of the peak, which accumulation and checkpointing do not "
                "shrink: train fewer parameters (e.g. LoRA), use a lighter optimizer, "
                "or shard the state (FSDP / ZeRO)"
            )
    if result.precision == "fp32":
        tips.append("lower precision: precision: bf16 (autocast) roughly halves activations")
    grown = result.grown
    if grown:
        top = grown[0]
        tips.append(
            f"or undo the growth since the baseline (largest: {top.name} "
            f"{_quantity_label(top.quantity)} +{format_bytes(top.delta)}); if it is "
            "intended, raise the budget and run `memplan check --update-baseline`"
        )
    return tuple(tips)


def _quantity_label(quantity: str) -> str:
    return {
        "params_bytes": "params",
        "activation_bytes_per_sample": "activations/sample",
        "grad_bytes": "grads",
        "optimizer_state_bytes": "optimizer state",
    }[quantity]


def describe_growth(growth: Growth) -> str:
    """``transformer.h.3: params 2.0 MiB → 8.0 MiB (+6.0 MiB)``."""
    label = _quantity_label(growth.quantity)
    if growth.baseline is None:
        return f"{growth.name}: new, {label} {format_bytes(growth.current or 0)}"
    if growth.current is None:
        return f"{growth.name}: removed (had {label} {format_bytes(growth.baseline)})"
    sign = "+" if growth.delta >= 0 else "-"
    change = f" ({sign}{format_bytes(abs(growth.delta))}"
    if growth.baseline:
        change += f", {growth.delta / growth.baseline:+.0%}"
    return (
        f"{growth.name}: {label} {format_bytes(growth.baseline)} → "
        f"{format_bytes(growth.current)}{change})"
    )


def verdict(result: CheckResult) -> str:
    """One line: ``fits with 3.1 GiB headroom (13%)`` / ``exceeded by 1.2 GiB``."""
    if result.status == "error":
        return "could not check: " + result.message
    if result.min_peak_bytes is None:
        return "passes" if result.status == "pass" else ("no plan fits: " + result.message)
    headroom = result.headroom_bytes or 0
    if headroom >= 0:
        fraction = headroom / result.budget_bytes if result.budget_bytes else 0.0
        return f"fits with {format_bytes(headroom)} headroom ({fraction:.0%} of the budget)"
    return (
        f"exceeded by {format_bytes(-headroom)} (minimum peak "
        f"{format_bytes(result.min_peak_bytes)} vs {format_bytes(result.usable_budget_bytes)}"
        f" usable of {format_bytes(result.budget_bytes)})"
    )


def plan_text(plan: PlanSummary | None) -> str:
    """``8×4, ckpt 3/12``: micro-batch × accumulation (× world), checkpointed of candidates."""
    if plan is None:
        return "-"
    return (
        f"{plan.micro_batch_size}×{plan.accumulation_steps}"
        + (f"×{plan.world_size}" if plan.world_size > 1 else "")
        + f", ckpt {plan.checkpointed}/{plan.n_layers}"
    )


# ----------------------------------------------------------------------------- JSON
def to_json_data(report: CheckReport) -> dict[str, Any]:
    """The ``memplan check --json`` object (documented in docs/ci.md)::

        {
          "memplan_version": str, "config": str, "passed": bool, "exit_code": int,
          "summary": {"total": int, "passed": int, "failed": int, "errors": int,
                      "seconds": float},
          "checks": [{
            "name": str, "status": "pass" | "fail" | "error", "model": str,
            "device": str, "device_profile": str | null, "precision": str,
            "target_batch": int, "world_size": int,
            "budget_bytes": int, "margin": float, "usable_budget_bytes": int,
            "min_peak_bytes": int | null, "headroom_bytes": int | null,
            "exceeded_by_bytes": int | null,
            "plan": null | {"micro_batch_size": int, "accumulation_steps": int,
                            "world_size": int, "checkpointed": int, "n_layers": int,
                            "checkpoint_layers": [str], "peak_bytes": int,
                            "step_seconds": float, "peak_phase": str,
                            "breakdown": {"params": int, "grads": int, "optimizer": int,
                                          "activations": int, "transient": int,
                                          "reserve": int}},
            "baseline": str | null, "baseline_updated": bool, "baseline_note": str,
            "growth": [{"name": str, "kind": "layer" | "fixed" | "total",
                        "quantity": "params_bytes" | "activation_bytes_per_sample"
                                    | "grad_bytes" | "optimizer_state_bytes",
                        "baseline": float | null, "current": float | null,
                        "delta": float}],
            "advice": [str], "message": str, "exit_code": int,
            "seconds": {"probe": float, "solve": float, "total": float}
          }]
        }

    ``plan`` is the plan a passing check would use, or the closest plan of a failing one.
    """
    from memplan import __version__

    checks = []
    for r in report.results:
        plan = None
        if r.plan is not None:
            plan = {
                "micro_batch_size": r.plan.micro_batch_size,
                "accumulation_steps": r.plan.accumulation_steps,
                "world_size": r.plan.world_size,
                "checkpointed": r.plan.checkpointed,
                "n_layers": r.plan.n_layers,
                "checkpoint_layers": list(r.plan.checkpoint_layers),
                "peak_bytes": r.plan.peak_bytes,
                "step_seconds": r.plan.step_seconds,
                "peak_phase": r.plan.peak_phase,
                "breakdown": dict(r.plan.breakdown),
            }
        checks.append(
            {
                "name": r.name,
                "status": r.status,
                "model": r.model,
                "device": r.device,
                "device_profile": r.device_profile,
                "precision": r.precision,
                "target_batch": r.target_batch,
                "world_size": r.world_size,
                "budget_bytes": r.budget_bytes,
                "margin": r.margin,
                "usable_budget_bytes": r.usable_budget_bytes,
                "min_peak_bytes": r.min_peak_bytes,
                "headroom_bytes": r.headroom_bytes,
                "exceeded_by_bytes": r.exceeded_by_bytes,
                "plan": plan,
                "baseline": r.baseline,
                "baseline_updated": r.baseline_updated,
                "baseline_note": r.baseline_note,
                "growth": [
                    {
                        "name": g.name,
                        "kind": g.kind,
                        "quantity": g.quantity,
                        "baseline": g.baseline,
                        "current": g.current,
                        "delta": g.delta,
                    }
                    for g in r.growth
                ],
                "advice": list(r.advice),
                "message": r.message,
                "exit_code": r.exit_code,
                "seconds": {"probe": r.probe_seconds, "solve": r.solve_seconds, "total": r.seconds},
            }
        )
    return {
        "memplan_version": __version__,
        "config": report.config,
        "passed": report.passed,
        "exit_code": report.exit_code,
        "summary": {
            "total": len(report.results),
            "passed": report.count("pass"),
            "failed": report.count("fail"),
            "errors": report.count("error"),
            "seconds": sum(r.seconds for r in report.results),
        },
        "checks": checks,
    }


def to_json(report: CheckReport) -> str:
    return json.dumps(to_json_data(report), indent=2)


# ----------------------------------------------------------------------------- JUnit
def failure_text(result: CheckResult) -> str:
    """The failure paragraph: verdict, what grew, what to do."""
    lines = [verdict(result)]
    grown = result.grown
    if grown:
        lines.append("grew since the baseline:")
        lines += [f"  {describe_growth(g)}" for g in grown]
    if result.baseline_note:
        lines.append(f"note: {result.baseline_note}")
    if result.advice:
        lines.append("what to do:")
        lines += [f"  - {tip}" for tip in result.advice]
    return "\n".join(lines)


def to_junit_xml(report: CheckReport) -> str:
    """One ``<testcase>`` per check in one ``<testsuite name="memplan check">``; a check over
    budget is a ``<failure>``, one that could not be measured an ``<error>``."""
    suite = ET.Element(
        "testsuite",
        {
            "name": "memplan check",
            "tests": str(len(report.results)),
            "failures": str(report.count("fail")),
            "errors": str(report.count("error")),
            "skipped": "0",
            "time": f"{sum(r.seconds for r in report.results):.3f}",
        },
    )
    for r in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            {"classname": "memplan.check", "name": r.name, "time": f"{r.seconds:.3f}"},
        )
        if r.status == "fail":
            failure = ET.SubElement(case, "failure", {"message": verdict(r), "type": "OverBudget"})
            failure.text = failure_text(r)
        elif r.status == "error":
            error = ET.SubElement(case, "error", {"message": r.message, "type": "CannotCheck"})
            error.text = r.message
        else:
            out = ET.SubElement(case, "system-out")
            out.text = f"{verdict(r)}; plan {plan_text(r.plan)}"
    root = ET.Element(
        "testsuites",
        {
            "tests": suite.get("tests", "0"),
            "failures": suite.get("failures", "0"),
            "errors": suite.get("errors", "0"),
        },
    )
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# ----------------------------------------------------------------------------- markdown
def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: CheckReport) -> str:
    """The GitHub step summary: a table of checks, then the details of each failure."""
    icon = {"pass": "✅ pass", "fail": "❌ fail", "error": "⚠️ error"}
    head = "passed" if report.passed else "failed"
    lines = [
        f"### memplan check: {head} ({report.count('pass')}/{len(report.results)})",
        "",
        "| check | result | min peak | budget | headroom | plan (micro × accum, ckpt) | time |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in report.results:
        peak = format_bytes(r.min_peak_bytes) if r.min_peak_bytes is not None else "-"
        headroom = format_bytes(r.headroom_bytes) if r.headroom_bytes is not None else "-"
        lines.append(
            f"| {_md(r.name)} | {icon[r.status]} | {peak} | "
            f"{format_bytes(r.budget_bytes)} | {headroom} | {plan_text(r.plan)} | "
            f"{r.seconds:.1f} s |"
        )
    for r in report.results:
        if r.status == "pass":
            continue
        lines += [
            "",
            f"#### {_md(r.name)}",
            "",
            "```",
            failure_text(r) if r.status == "fail" else r.message,
            "```",
        ]
    return "\n".join(lines) + "\n"


def append_step_summary(
    report: CheckReport, path: str | os.PathLike[str] | None = None
) -> Path | None:
    """Append the markdown summary to ``$GITHUB_STEP_SUMMARY`` (or ``path``); None when
    neither is set. GitHub gives each step its own file and concatenates them, so append."""
    target = path or os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    with open(target, "a", encoding="utf-8") as handle:
        handle.write(to_markdown(report))
    return Path(target)


# ----------------------------------------------------------------------------- init-check
def starter_config(
    *,
    model: str,
    name: str,
    target_batch: int,
    budget: str,
    device: str = "meta",
    device_profile: str | None = None,
    precision: str = "fp32",
    baseline: str | None = None,
) -> str:
    """A commented starter memplan.yaml with one check."""
    lines = [
        "# memplan check: the CI memory-budget gate (docs/ci.md). Run `memplan check`.",
        "# Paths are relative to this file. Sizes: 24GiB, 512MiB, or 80% of device_profile.",
        f"version: {CONFIG_VERSION}",
        "checks:",
        f"  - name: {json.dumps(name)}",
        f"    model: {json.dumps(model)}",
        f"    target_batch: {target_batch}          # effective batch (micro × accumulation × world)",
        f"    budget: {json.dumps(budget)}",
        f"    device: {device}               # how to probe in CI: meta (fast, no memory), cpu, cuda",
    ]
    if device_profile:
        lines.append(f"    device_profile: {device_profile}   # GPU spec: capacity and speed")
    else:
        lines.append(
            "    # device_profile: rtx4090     # GPU spec: capacity (for % budgets) and speed"
        )
    lines += [
        f"    precision: {precision}           # fp32 | bf16 | fp16",
        "    world_size: 1",
        "    margin: 0.03              # fraction of the budget kept free",
    ]
    if baseline:
        lines.append(
            f"    baseline: {json.dumps(baseline)}   # write/refresh: memplan check --update-baseline"
        )
    else:
        lines.append(
            "    # baseline: memplan/baseline/model.profile.yaml   # then: memplan check --update-baseline"
        )
    return "\n".join(lines) + "\n"


def suggest_budget(
    model_arg: str,
    *,
    target_batch: int,
    device: str = "meta",
    precision: str = "fp32",
    device_profile: str | None = None,
    headroom: float = 0.25,
) -> tuple[str, int]:
    """Probe ``model_arg`` and return a budget string ``headroom`` above its minimum peak for
    ``target_batch`` (and that minimum peak in bytes), for ``memplan init-check``."""
    result = check_model(
        model_arg,
        target_batch=target_batch,
        budget=2**50,  # 1 PiB: every plan fits, and the check still reports the least peak
        device=device,
        precision=precision,
        device_profile=device_profile,
    )
    if result.status == "error":
        error = MemplanError(result.message)
        error.exit_code = result.exit_code
        raise error
    if result.min_peak_bytes is None:
        raise BadInputError(f"{model_arg}: the solver reported no minimum peak.")
    min_peak = result.min_peak_bytes
    return suggested_budget(int(min_peak * (1 + headroom)), 0.03), min_peak


# ----------------------------------------------------------------------------- benchmark
def check_model(
    model: str,
    *,
    target_batch: int,
    budget: str | int | None = None,
    name: str | None = None,
    **fields: Any,
) -> CheckResult:
    """One check without a memplan.yaml: ``fields`` are CheckSpec's (device, device_profile,
    precision, micro_batches, world_size, margin, baseline, layers); relative paths are
    relative to the working directory. The result carries ``probe_seconds`` and
    ``solve_seconds``, so the benchmark can time a check per bundled example."""
    raw = {
        "name": name or Path(model).stem,
        "model": model,
        "target_batch": target_batch,
        "budget": budget,
        **fields,
    }
    spec = from_data(CheckSpec, raw, source="check_model()", path="check")
    return run_check(_resolve(spec, 0, Path.cwd(), "check_model()"))


def time_checks(
    config: str | os.PathLike[str] = DEFAULT_CONFIG, *, only: Sequence[str] | None = None
) -> dict[str, dict[str, float | str]]:
    """Run the checks of ``config`` and return, per check name, its status and the seconds
    spent probing and solving (for the benchmark's check-speed section)."""
    report = run_checks(config, only=only)
    return {
        r.name: {
            "status": r.status,
            "probe_seconds": r.probe_seconds,
            "solve_seconds": r.solve_seconds,
            "seconds": r.seconds,
        }
        for r in report.results
    }


__all__ = [
    "CheckConfig",
    "CheckReport",
    "CheckResult",
    "CheckSpec",
    "Growth",
    "PlanSummary",
    "ResolvedCheck",
    "append_step_summary",
    "check_model",
    "diff_profiles",
    "load_config",
    "run_check",
    "run_checks",
    "starter_config",
    "suggest_budget",
    "time_checks",
    "to_json",
    "to_json_data",
    "to_junit_xml",
    "to_markdown",
]
