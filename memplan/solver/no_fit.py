"""When no plan fits: the error with the least peak any plan needs, the closest plan, and hints
that name what would help (divisors, --layers, --margin 0). No torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from memplan import memory
from memplan.errors import NoPlanFitsError
from memplan.solver.explain import plan_warnings
from memplan.solver.options import PlanOption, SolveContext, build_plan, sharding_for
from memplan.units import format_bytes


def no_plan_fits_error(
    ctx: SolveContext, options: Sequence[PlanOption], bn_floor: int | None
) -> NoPlanFitsError:
    profile, request = ctx.profile, ctx.request
    allowed = [o for o in options if o.allowed]
    # within --host-memory first: a micro-batch whose forced offload alone exceeds it is
    # no plan to point at (it had been named as the least peak, 0 B of activations)
    closest = min(allowed, key=lambda o: (not o.within_host, o.peak.peak_bytes, o.rank))
    least = closest.peak.peak_bytes
    n = len(profile.layers)
    strategies = ", ".join(ctx.strategies)
    message = (
        f"No plan ({strategies} on {request.world_size} rank(s)) for target batch "
        f"{request.target_batch} fits "
        f"{format_bytes(request.budget_bytes)} (less {request.margin:.0%} margin: "
        f"{format_bytes(ctx.usable_bytes)}). The smallest peak any plan needs is "
        f"{format_bytes(least)} per rank: {closest.strategy}, micro-batch "
        f"{closest.micro_batch} × "
        f"{closest.accumulation_steps} accumulation step(s), {len(closest.checkpointed)} of "
        f"{n} layers checkpointed, peaking during {closest.peak.where}."
    )
    hints = []
    if request.margin > 0 and least <= request.budget_bytes:
        # Only the safety margin rules the closest plan out: say so, and how to plan anyway.
        accepted = math.floor((1.0 - least / request.budget_bytes) * 1000) / 1000
        smaller = f" (or --margin {accepted:g})" if accepted > 0 else ""
        hints.append(
            f"the budget itself holds that plan ({format_bytes(least)} <= "
            f"{format_bytes(request.budget_bytes)}): only the {request.margin:.0%} safety "
            f"margin rules it out; --margin 0{smaller} plans without it, at the risk of running "
            f"out of memory if the real peak exceeds the prediction"
        )
    hints.append(
        f"a budget of at least "
        f"{format_bytes(memory.budget_for_peak_bytes(least, request.margin), precision=2)}"
    )
    hints.extend(_smaller_micro_hints(ctx, options, bn_floor))
    hints.extend(_layers_hint(ctx, closest, least))
    state = (
        memory.params_bytes(profile)
        + memory.grads_bytes(profile)
        + memory.optimizer_state_bytes(profile)
    )
    trainable_state = memory.grads_bytes(profile) + memory.optimizer_state_bytes(profile)
    reserve = closest.peak.reserve_bytes
    if reserve >= ctx.usable_bytes:
        # (before, this was said as the model state exceeding the budget, and sharding it
        # advised, though the state was a third of the budget and the reserve all of it)
        hints.append(
            f"the CUDA reserve alone ({format_bytes(reserve)}: the allocator's reserve, "
            "NCCL's buffers and the CUDA context, as the device profile gives them) takes "
            "the whole budget, and no sharding, precision, adapters or "
            "checkpointing shrinks it"
        )
    elif state + reserve > ctx.usable_bytes and "fsdp" not in ctx.strategies:
        also = f" with the {format_bytes(reserve)} CUDA reserve" if reserve else ""
        hints.append(
            f"the model state alone (params {format_bytes(memory.params_bytes(profile))}, "
            f"grads {format_bytes(memory.grads_bytes(profile))}, optimizer "
            f"{format_bytes(memory.optimizer_state_bytes(profile))}){also} exceeds the budget: shard "
            f"it across ranks (FSDP / ZeRO; more DDP ranks alone do not shrink per-rank memory)"
        )
    if profile.environment.precision == "fp32" and reserve < ctx.usable_bytes:
        hints.append(
            "lower precision (bf16 autocast roughly halves activation bytes; probe again with it)"
        )
    if trainable_state > 0 and reserve < ctx.usable_bytes:
        hints.append(
            f"training adapters only (e.g. LoRA) drops most of the "
            f"{format_bytes(trainable_state)} of gradients and optimizer state"
        )
    closest_plan = build_plan(ctx, closest, [message], plan_warnings(ctx, closest))
    return NoPlanFitsError(
        message,
        hint="What would fit: " + "; ".join(hints) + ".",
        min_peak_bytes=least,
        closest=closest_plan,
    )


def _layers_hint(ctx: SolveContext, closest: PlanOption, least: int) -> list[str]:
    """Whether naming other checkpoint candidates (``--layers``) could help: only when the
    closest plan already checkpoints every candidate, and only as much as the activations
    the fixed parts (everything outside the candidates) keep at its micro-batch."""
    profile = ctx.profile
    n = len(profile.layers)
    if n and len(closest.checkpointed) < n:
        return []
    outside = int(sum(part.saved_bytes.at(closest.micro_batch) for part in profile.fixed))
    deficit = least - ctx.usable_bytes
    if outside >= deficit > 0:
        parts = sorted(profile.fixed, key=lambda p: -p.saved_bytes.at(closest.micro_batch))
        names = ", ".join(p.name for p in parts[:3])
        return [
            f"more checkpoint candidates (probe again with --layers GLOB naming finer or more "
            f"modules): outside the {n} candidate layer(s), {names} keep "
            f"{format_bytes(outside)} of activations at micro-batch {closest.micro_batch}"
        ]
    return [
        f"not --layers: every candidate is already checkpointed, and the activations outside "
        f"them ({format_bytes(outside)}) are less than the {format_bytes(deficit)} missing"
    ]


def _smaller_micro_hints(
    ctx: SolveContext, options: Sequence[PlanOption], bn_floor: int | None
) -> list[str]:
    """Smaller micro-batches this request excludes that would fit."""
    request = ctx.request
    hints = []
    excluded_fit = [o for o in options if not o.allowed and o.fits]
    if excluded_fit:
        best = max(excluded_fit, key=lambda o: o.micro_batch)
        hints.append(
            f"micro-batch {best.micro_batch} would fit "
            f"({format_bytes(best.peak.peak_bytes)}) but is below the BatchNorm floor "
            f"of {bn_floor} (--allow-small-bn-micro)"
        )
        return hints
    smallest = min(o.micro_batch for o in options)
    per_rank = request.target_batch // request.world_size
    least_option = min(options, key=lambda o: (o.peak.peak_bytes, o.rank))
    sharding = sharding_for(ctx, least_option.strategy, least_option.grad_sync)
    # The largest smaller divisor of the per-rank batch that fits; a non-divisor only when
    # no divisor fits (and then with a target it divides, never as a --min-micro).
    divisors = [b for b in range(smallest - 1, 0, -1) if per_rank % b == 0]
    others = [b for b in range(smallest - 1, max(0, smallest - 65), -1) if per_rank % b]
    for b in divisors + others:
        accumulation = per_rank // b if per_rank % b == 0 else 2
        bounds = memory.step_bounds(ctx.profile, b, accumulation, sharding)
        if not memory.fits_somehow(
            bounds, ctx.limit_bytes, forced_in=ctx.forced_in, forced_out=ctx.forced_out
        ):
            continue
        least = memory.min_allocated_bytes(
            bounds, forced_in=ctx.forced_in, forced_out=ctx.forced_out
        )
        needs = format_bytes(least + ctx.reserve.bytes_for(least))
        if per_rank % b == 0 and b < request.min_micro:
            why = f"lower --min-micro to {b}"
        elif per_rank % b == 0 and bn_floor is not None and b < bn_floor:
            why = "allow it with --allow-small-bn-micro"
        else:
            unit = b * request.world_size
            nearest = max(unit, round(request.target_batch / unit) * unit)
            why = f"choose a target batch it divides, e.g. {nearest}"
        hints.append(f"micro-batch {b} would fit ({needs}): {why}")
        break
    return hints
