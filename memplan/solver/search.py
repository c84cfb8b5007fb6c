"""The search at one batch on one profile: validate a request, evaluate every option, pick the
plan (``solve_batch``) or the least peak any plan needs (``least_peak``). No torch. A request
with a sequence length or a layout goes through ``memplan.solver.solve`` (memplan.solver.entry),
which calls this once per length or pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan import memory, retime, timing
from memplan.errors import BadInputError
from memplan.plan import STRATEGIES, Plan
from memplan.profile import Profile
from memplan.profile.seqlen import check_seq_len
from memplan.solver.batches import micro_batch_sizes, split_error
from memplan.solver.explain import candidate_of, plan_reasons, plan_warnings
from memplan.solver.layer_names import forced_layers
from memplan.solver.no_fit import no_plan_fits_error
from memplan.solver.options import (
    PlanOption,
    SolveContext,
    build_plan,
    evaluate_micro_batches,
    has_batchnorm,
    resolve_modes,
    strategies_to_try,
)
from memplan.solver.request import SolveRequest, SolveResult


@dataclass(frozen=True, kw_only=True, slots=True)
class _Setup:
    """What ``solve`` and ``least_peak`` share: the context and every option evaluated."""

    ctx: SolveContext
    options: tuple[PlanOption, ...]
    bn_floor: int | None
    source_reason: str


def _setup(profile: Profile, request: SolveRequest, *, ignore_budget: bool = False) -> _Setup:
    """Validate ``request`` against ``profile`` and evaluate every (strategy, micro-batch)
    option against the allocated limit of the request's budget; ``ignore_budget``: against
    no budget at all, so that each option is evaluated at the least peak it can reach."""
    if request.target_batch is None or request.seq_len is not None or request.layout:
        raise BadInputError(
            "a request with a sequence length, a batch in tokens or a layout is solved by "
            "memplan.solver.solve, not at one batch."
        )
    if profile.seq_len is not None:  # the plan records it: a plan its reader takes
        check_seq_len(profile.seq_len, flag="The profile's seq_len")
    forced_in, forced_out = forced_layers(profile, request)

    target, world = request.target_batch, request.world_size
    lo, hi = request.min_micro, request.max_micro
    if target % world:
        raise split_error(
            target, world, lo, hi, f"{target} is not a multiple of world_size {world}"
        )
    micro_batches = micro_batch_sizes(target, world, lo, hi)
    if not micro_batches:
        raise split_error(
            target, world, lo, hi, f"no micro-batch in that range divides {target // world}"
        )
    bn_floor = None
    if has_batchnorm(profile) and not request.allow_small_bn_micro:
        bn_floor = request.bn_min_micro
        if not any(b >= bn_floor for b in micro_batches):
            raise split_error(
                target,
                world,
                max(lo, bn_floor),
                hi,
                f"the model has BatchNorm and every possible micro-batch "
                f"({', '.join(map(str, micro_batches))}) is below bn_min_micro {bn_floor}",
                extra_hint=" Or allow small micro-batches (--allow-small-bn-micro) or lower "
                "--bn-min-micro, knowing BatchNorm statistics get noisier.",
            )

    reserve = memory.reserve_for(
        profile,
        request.device_spec,
        # auto: the streams of the most sharded strategy it may pick (never under)
        memory.Sharding(
            strategy="fsdp" if request.strategy == "auto" else request.strategy,
            world_size=request.world_size,
        ),
        request.communicators,
    )
    source, source_reason = retime.choose_timing_source(
        profile, request.device_spec, request.timing
    )
    bandwidth, bandwidth_source = timing.interconnect_bandwidth(request.device_spec)
    if request.data_parallel_bandwidth is not None:
        bandwidth = request.data_parallel_bandwidth
        bandwidth_source = "the layout's data-parallel group (NVLink within a node, NICs between)"
    strategies = strategies_to_try(profile, request)
    modes, host_link = resolve_modes(profile, request, forced_in)
    ctx = SolveContext(
        modes=modes,
        host_link=host_link,
        profile=profile,
        request=request,
        forced_in=forced_in,
        forced_out=forced_out,
        reserve=reserve,
        # Ignoring the budget, a limit below every peak: no option fits, and each is
        # evaluated at its least peak (the number a NoPlanFitsError reports).
        limit_bytes=-1
        if ignore_budget
        else memory.allocated_limit_bytes(request.budget_bytes, request.margin, reserve),
        ignore_budget=ignore_budget,
        usable_bytes=memory.usable_budget_bytes(request.budget_bytes, request.margin),
        timing_source=source,
        bandwidth=bandwidth,
        bandwidth_source=bandwidth_source,
        strategies=strategies,
    )
    per_rank = target // world
    options = tuple(
        option
        for st in strategies
        for option in evaluate_micro_batches(ctx, micro_batches, per_rank, bn_floor, st)
    )
    negative = next((o for o in options if o.peak.peak_bytes < 0), None)
    if negative is not None:
        t = profile.totals
        raise BadInputError(
            f"The profile predicts a negative peak per rank ({negative.peak.peak_bytes:,} "
            f"bytes) at micro-batch {negative.micro_batch} with {negative.strategy} on "
            f"{world} rank(s): a rank's share of its parameters ({t.params_trainable_bytes:,} "
            f"+ {t.params_frozen_bytes:,} bytes), gradients ({t.grad_bytes:,}) and optimizer "
            f"state ({t.optimizer_state_bytes:,}) is taken from live bytes its timeline never "
            "measured, so the profile was edited or corrupted.",
            hint="Probe the model again (memplan probe).",
        )
    return _Setup(ctx=ctx, options=options, bn_floor=bn_floor, source_reason=source_reason)


def has_plan(profile: Profile, request: SolveRequest) -> bool:
    """Whether some allowed plan for ``request`` fits its budget (what ``solve`` would
    answer with a plan rather than NoPlanFitsError). Raises BadInputError as ``solve_batch``."""
    return any(o.allowed and o.fits for o in _setup(profile, request).options)


def solve_batch(profile: Profile, request: SolveRequest) -> SolveResult:
    """Choose micro-batch, accumulation and checkpoint set for ``request`` (a target batch
    in samples, no length, no layout) on ``profile``.

    Raises BadInputError when the target cannot be split or a layer name is unknown, and
    NoPlanFitsError (with the least peak any plan needs and the closest plan) when no
    plan fits the budget."""
    setup = _setup(profile, request)
    result = _result(setup)
    if result is None:
        raise no_plan_fits_error(setup.ctx, setup.options, setup.bn_floor)
    return result


def least_peak_bytes(profile: Profile, request: SolveRequest) -> int:
    """The least peak any plan of ``request`` (budget aside) reaches on ``profile``."""
    options = [o for o in _setup(profile, request, ignore_budget=True).options if o.allowed]
    return min(o.peak.peak_bytes for o in options)


def solve_if_fits(
    profile: Profile, request: SolveRequest, *, explain: bool = True
) -> SolveResult | None:
    """``solve_batch``'s answer, or None when no plan fits (what the layout search asks of each
    pipeline stage: no error to build when a layout does not fit). ``explain=False``: no
    reasons or warnings (the search explains the layout it picks)."""
    return _result(_setup(profile, request), explain=explain)


def _result(setup: _Setup, *, explain: bool = True) -> SolveResult | None:
    ctx, options, bn_floor = setup.ctx, setup.options, setup.bn_floor
    fitting = [o for o in options if o.allowed and o.fits]
    if not fitting:
        return None
    least_sharded = min(STRATEGIES.index(o.strategy) for o in fitting)
    best = min(
        (o for o in fitting if STRATEGIES.index(o.strategy) == least_sharded),
        key=lambda o: o.rank,
    )
    if explain:
        reasons = plan_reasons(ctx, best, options, bn_floor, setup.source_reason)
        warnings = plan_warnings(ctx, best)
    else:
        reasons, warnings = [], []
    plan = build_plan(ctx, best, reasons, warnings)
    return SolveResult(
        plan=plan,
        candidates=tuple(candidate_of(ctx, o, best, bn_floor) for o in options) if explain else (),
        usable_budget_bytes=ctx.usable_bytes,
        reserve=ctx.reserve,
        timing_source=setup.source_reason,
        once_seconds=best.times.optimizer_step_seconds + best.comm_seconds,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class LeastPeak:
    """The least per-rank peak any plan for a target batch needs, whatever the budget."""

    peak_bytes: int
    """Predicted peak of ``plan`` (allocated bytes plus the reserve)."""
    plan: Plan
    """A plan of least peak (ties broken in the solver's order: fastest, fewest checkpoints)."""


def least_peak(profile: Profile, request: SolveRequest) -> LeastPeak:
    """The least peak any allowed plan for ``request``'s target batch, world size and
    strategies needs; ``request.budget_bytes`` is not consulted. Each option's peak is the
    least its checkpoint sets reach (``memory.min_allocated_bytes``): the number a
    ``NoPlanFitsError`` reports. Raises BadInputError when the target cannot be split."""
    setup = _setup(profile, request, ignore_budget=True)
    allowed = [o for o in setup.options if o.allowed]
    # within --host-memory first: a micro-batch whose forced offload alone exceeds it is
    # no plan to point at (it had been named as the least peak, 0 B of activations)
    closest = min(allowed, key=lambda o: (not o.within_host, o.peak.peak_bytes, o.rank))
    plan = build_plan(setup.ctx, closest, (), plan_warnings(setup.ctx, closest))
    return LeastPeak(peak_bytes=closest.peak.peak_bytes, plan=plan)
