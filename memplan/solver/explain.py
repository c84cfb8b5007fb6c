"""Why the solver chose what it chose: the candidates table, and the reasons and warnings on
a plan (memplan.solver.no_fit explains a solve with no plan). No torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from memplan import memory, timing
from memplan.devices import DeviceSpec
from memplan.memory import Peak
from memplan.modes import FULL, KEEP, MODES
from memplan.plan import STRATEGIES
from memplan.profile import OP_SEQUENCE_DIFFERED, Profile
from memplan.solver.layer_names import layer_names_of, short_list
from memplan.solver.options import (
    PlanOption,
    SolveContext,
    bar_slow_selective,
    barred_selective_reason,
    has_batchnorm,
    sharding_for,
)
from memplan.solver.request import Candidate
from memplan.units import format_bytes, format_seconds


# --------------------------------------------------------------------------- explaining
def _over_by(ctx: SolveContext, option: PlanOption) -> str:
    return (
        f"micro-batch {option.micro_batch} would need {format_bytes(option.peak.peak_bytes)}: "
        f"over budget by {format_bytes(option.peak.peak_bytes - ctx.usable_bytes)}"
    )


def candidate_of(
    ctx: SolveContext, option: PlanOption, best: PlanOption | None, bn_floor: int | None
) -> Candidate:
    target = ctx.request.target_batch
    chosen = best is not None and option is best
    notes = []
    # Short: the table beside it already shows peak, time and relative speed.
    if chosen:
        notes.append("chosen")
    elif not option.fits:
        notes.append(f"over budget by {format_bytes(option.peak.peak_bytes - ctx.usable_bytes)}")
    elif option.allowed and best is not None:
        slower = option.step_seconds / best.step_seconds - 1 if best.step_seconds > 0 else 0.0
        notes.append(
            f"fits; {slower:+.1%} time" if slower > 0.0005 else "fits; tie, lost on tie-break"
        )
    else:
        notes.append("fits")
    if not option.allowed:
        notes.append(f"below the BatchNorm floor of {bn_floor}")
    if option.strategy == "fsdp" and option.accumulation_steps > 1:
        notes.append(
            "reduce-scatter every micro-step"
            if option.grad_sync == "every_micro_step"
            else "reduce-scatter on the last micro-step"
        )
    layers = ctx.profile.layers
    return Candidate(
        micro_batch=option.micro_batch,
        accumulation_steps=option.accumulation_steps,
        feasible=option.fits and option.allowed,
        fits=option.fits,
        chosen=chosen,
        checkpoint_layers=layer_names_of(ctx.profile, option.checkpointed),
        n_checkpointed=len(option.checkpointed),
        checkpoint={layers[i].name: mode for i, mode in sorted(option.checkpointed.items())},
        peak_bytes=option.peak.peak_bytes,
        step_seconds=option.step_seconds,
        samples_per_second=target / option.step_seconds if option.step_seconds > 0 else math.inf,
        peak_phase=option.peak.where,
        note="; ".join(notes),
        strategy=option.strategy,
        grad_sync=option.grad_sync,
    )


def _breakdown_text(peak: Peak) -> str:
    b = peak.breakdown
    parts = [
        ("params", b.params),
        ("grads", b.grads),
        ("optimizer", b.optimizer),
        ("activations", b.activations),
        ("transient", b.transient),
        ("reserve", b.reserve),
    ]
    return ", ".join(f"{name} {format_bytes(value)}" for name, value in parts if value)


def _least_peak(options: Sequence[PlanOption], strategy: str) -> PlanOption | None:
    mine = [o for o in options if o.strategy == strategy and o.allowed]
    return min(mine, key=lambda o: (o.peak.peak_bytes, o.rank)) if mine else None


def _strategy_reasons(
    ctx: SolveContext, best: PlanOption, options: Sequence[PlanOption]
) -> list[str]:
    """Why this strategy, and what its communication costs."""
    request = ctx.request
    world = request.world_size
    if world == 1 and best.strategy == "ddp":
        return []
    lines = []
    if request.strategy != "auto":
        lines.append(f"strategy {best.strategy}, as requested; memory figures are per rank")
    else:
        less = STRATEGIES[: STRATEGIES.index(best.strategy)]
        if not less:
            lines.append(
                "strategy ddp (auto): the least-sharded strategy, and it fits (sharding "
                "adds communication and ties every rank's state to the others')"
            )
        else:
            why = []
            for strategy in less:
                least = _least_peak(options, strategy)
                if least is not None:
                    why.append(
                        f"{strategy} needs {format_bytes(least.peak.peak_bytes)} per rank at "
                        f"the least, over the usable {format_bytes(ctx.usable_bytes)}"
                    )
            lines.append(
                f"strategy {best.strategy} (auto): the least-sharded strategy that fits; "
                + "; ".join(why)
            )
        more = STRATEGIES[STRATEGIES.index(best.strategy) + 1 :]
        faster = [
            o
            for o in options
            if o.strategy in more and o.allowed and o.fits and o.step_seconds < best.step_seconds
        ]
        if faster:
            quickest = min(faster, key=lambda o: o.rank)
            gain = 1 - quickest.step_seconds / best.step_seconds if best.step_seconds else 0.0
            if gain >= 0.01:
                lines.append(
                    f"{quickest.strategy} would be {gain:.1%} faster by the model "
                    f"({format_seconds(quickest.step_seconds)} per step: micro-batch "
                    f"{quickest.micro_batch}, {len(quickest.checkpointed)} layers checkpointed) "
                    f"at the cost of more communication and sharded state: "
                    f"--strategy {quickest.strategy}"
                )
    if best.strategy == "ddp" and world > 1:
        lines.append(
            "DDP with gradient_as_bucket_view=True: its gradient buckets are resident all "
            "step, and are the gradients once synchronised"
        )
    if best.strategy == "fsdp" and ctx.profile.environment.mixed_precision == "params":
        lines.append(
            f"FSDP mixed precision: parameters gathered and computed in "
            f"{ctx.profile.environment.precision}, fp32 master shards and optimizer state, "
            "gradients reduced in fp32 (MixedPrecisionPolicy(param_dtype, reduce_dtype=float32))"
        )
    float8 = ctx.profile.environment.float8
    if float8 is not None:
        gather = (
            "FSDP2 gathers their weights in float8 (1 byte an element)"
            if float8.fsdp_float8_all_gather
            else "their weights gathered in bf16"
        )
        lines.append(
            f"float8: {float8.converted} linears as torchao's Float8Linear ({float8.recipe} "
            f"scaling; {len(float8.skipped)} left in bf16), {gather}; "
            "their casts charged as eager torchao runs them (torch.compile fuses them)"
        )
    if ctx.profile.environment.compiled:
        lines.append(
            "step time as torch.compile runs it (probe --compiled): the memory-bound ops "
            "between two matmuls fused; the memory as eager holds it (an upper bound)"
        )
    if best.strategy == "fsdp" and best.accumulation_steps > 1:
        lines.append(_grad_sync_reason(best, options))
    if world > 1:
        lines.append(
            f"communication: {format_bytes(round(best.comm_bytes))} sent per rank per step "
            f"at {ctx.bandwidth / 1e9:g} GB/s ({ctx.bandwidth_source}): "
            f"+{format_seconds(best.comm_seconds - best.copy_seconds)}"
            + (
                f", and FSDP's copy-in/copy-out at memory bandwidth "
                f"+{format_seconds(best.copy_seconds)}"
                if best.copy_seconds
                else ""
            )
            + ", counted without overlap"
            + (
                f"; accumulating unreduced gradients over the micro-steps "
                f"+{format_seconds(best.accumulate_seconds)} at memory bandwidth"
                if best.accumulate_seconds
                else ""
            )
        )
    return lines


def _grad_sync_reason(best: PlanOption, options: Sequence[PlanOption]) -> str:
    """Why FSDP reduce-scatters when it does: the other way's peak and time at this size."""
    other = next(
        (
            o
            for o in options
            if o.strategy == best.strategy
            and o.micro_batch == best.micro_batch
            and o.grad_sync != best.grad_sync
        ),
        None,
    )
    if best.grad_sync == "last_micro_step":
        line = (
            "FSDP accumulates with set_requires_gradient_sync(False): gradients stay "
            "unsharded until the last micro-step (one reduce-scatter per step)"
        )
    else:
        line = (
            f"FSDP reduce-scatters every micro-step: gradients stay sharded "
            f"({best.accumulation_steps} reduce-scatters per step)"
        )
    if other is None:
        return line
    if not other.fits:
        why = f"the other way needs {format_bytes(other.peak.peak_bytes)} per rank and does not fit"
    else:
        slower = other.step_seconds / best.step_seconds - 1 if best.step_seconds > 0 else 0.0
        why = (
            f"the other way also fits ({format_bytes(other.peak.peak_bytes)} per rank) but "
            f"takes {format_seconds(other.step_seconds)} per step ({slower:+.1%})"
        )
    return f"{line}; {why}"


def plan_reasons(
    ctx: SolveContext,
    best: PlanOption,
    options: Sequence[PlanOption],
    bn_floor: int | None,
    source_reason: str,
) -> list[str]:
    profile, request = ctx.profile, ctx.request
    n = len(profile.layers)
    reasons = [
        f"effective batch {request.target_batch} = micro-batch {best.micro_batch} × "
        f"{best.accumulation_steps} accumulation step(s) × {request.world_size} rank(s)",
    ]
    reasons.extend(_strategy_reasons(ctx, best, options))
    budget_line = (
        f"budget {format_bytes(request.budget_bytes)} less {request.margin:.0%} "
        f"safety margin: predicted peaks must stay within "
        f"{format_bytes(ctx.usable_bytes)}"
    )
    if ctx.reserve.fixed_bytes or ctx.reserve.fragmentation_fraction:
        budget_line += (
            f", including {format_bytes(best.peak.reserve_bytes)} reserved for CUDA "
            f"({ctx.reserve.source})"
        )
    reasons.append(budget_line)
    target = target_reason(ctx.profile, request.device_spec)
    if target:
        reasons.append(target)
    throughput = request.target_batch / best.step_seconds if best.step_seconds > 0 else math.inf
    line = (
        f"micro-batch {best.micro_batch} is the fastest plan that fits: "
        f"{format_seconds(best.step_seconds)} per optimizer step, {throughput:,.1f} samples/s"
    )
    others = sorted(
        (o for o in options if o.allowed and o.fits and o is not best), key=lambda o: o.rank
    )
    if others:
        runner = others[0]
        slower = runner.step_seconds / best.step_seconds - 1 if best.step_seconds > 0 else 0.0
        other = "" if runner.strategy == best.strategy else f" with {runner.strategy}"
        line += (
            f"; next best, micro-batch {runner.micro_batch}{other}, takes "
            f"{format_seconds(runner.step_seconds)} ({slower:+.1%})"
        )
    reasons.append(line)
    too_big = [
        o
        for o in options
        if o.strategy == best.strategy
        and o.allowed
        and not o.fits
        and o.micro_batch > best.micro_batch
    ]
    reasons.extend(_over_by(ctx, o) for o in too_big[:3])
    if len(too_big) > 3:
        reasons.append(f"larger micro-batches (up to {too_big[-1].micro_batch}) need more still")

    names = layer_names_of(profile, best.checkpointed)
    if ctx.forced_in:
        reasons.append(
            f"always checkpointed, as requested: {short_list(layer_names_of(profile, ctx.forced_in))}"
        )
    if ctx.forced_out:
        reasons.append(
            f"never checkpointed, as requested: {short_list(layer_names_of(profile, ctx.forced_out))}"
        )
    if not names:
        reasons.append(
            f"no activation checkpointing needed: the peak of "
            f"{format_bytes(best.peak.peak_bytes)} fits without it"
        )
    else:
        recompute = timing.recompute_seconds(best.times, best.checkpointed)
        micro = timing.micro_step_seconds(best.times, best.checkpointed)
        plain = memory.step_peak(
            profile,
            best.micro_batch,
            ctx.forced_in,
            best.accumulation_steps,
            reserve=ctx.reserve,
            sharding=sharding_for(ctx, best.strategy, best.grad_sync),
        )
        without = (
            ""
            if plain.peak_bytes <= ctx.usable_bytes
            else f"; without it micro-batch {best.micro_batch} would need "
            f"{format_bytes(plain.peak_bytes)}"
        )
        used = sorted(set(best.checkpointed.values()), key=MODES.index)
        what = (
            "checkpointing"
            if used == [FULL]
            else "changing the mode of ("
            + ", ".join(
                f"{sum(m == mode for m in best.checkpointed.values())} {mode}" for mode in used
            )
            + ")"
        )
        reasons.append(
            f"{what} {len(names)} of {n} layers ({short_list(names)}): the least "
            f"extra time that fits, +{format_seconds(recompute)} per micro-step "
            f"({recompute / micro:.0%} of it){without}"
            if micro > 0
            else f"{what} {len(names)} of {n} layers ({short_list(names)}){without}"
        )
        reasons.extend(_layer_mode_reasons(ctx, best))
    reasons.append(
        f"peak {format_bytes(best.peak.peak_bytes)} during {best.peak.where}: "
        f"{_breakdown_text(best.peak)}"
    )
    if bn_floor is not None:
        excluded = [o.micro_batch for o in options if not o.allowed]
        if excluded:
            reasons.append(
                f"micro-batches below {bn_floor} ({', '.join(map(str, excluded))}) excluded: "
                f"the model has BatchNorm, whose statistics are computed per micro-batch "
                f"(--allow-small-bn-micro allows them)"
            )
    elif has_batchnorm(profile) and request.allow_small_bn_micro:
        reasons.append(f"BatchNorm floor of {request.bn_min_micro} waived, as requested")
    reasons.append(source_reason)
    return reasons


def _layer_mode_reasons(ctx: SolveContext, best: PlanOption) -> list[str]:
    """One line per layer not kept: its mode, what it frees and costs, and why no cheaper
    mode of that layer would do (with the other layers as they are, the plan would then
    exceed the budget or the host memory: the plan is the least-time one, so every cheaper
    swap fails). Then one line for the kept layers."""
    profile = ctx.profile
    bounds = memory.step_bounds(
        profile,
        best.micro_batch,
        best.accumulation_steps,
        sharding_for(ctx, best.strategy, best.grad_sync),
        modes=ctx.modes,
        host_limit_bytes=ctx.request.host_memory_bytes,
    )
    bounds = bar_slow_selective(bounds, best.times, ctx.modes)
    lines = []
    for i, mode in sorted(best.checkpointed.items()):
        cost = best.times.mode_seconds(i, mode)
        text = (
            f"{profile.layer_names[i]}: {mode}, frees {format_bytes(bounds.saving(mode, i))} "
            f"while held, +{format_seconds(cost)} per micro-step"
        )
        worse = []
        for other in bounds.allowed(i, ctx.forced_in, ctx.forced_out):
            if other == mode or best.times.mode_seconds(i, other) > cost:
                continue
            swapped = {**best.checkpointed, i: other}
            swapped = {j: m for j, m in swapped.items() if m != KEEP}
            over = memory.bounds_peak_bytes(bounds, swapped) - ctx.limit_bytes
            host = ctx.request.host_memory_bytes
            if over > 0:
                worse.append(f"{other} would exceed the budget by {format_bytes(over)}")
            elif host is not None and memory.host_total_bytes(bounds, swapped) > host:
                worse.append(f"{other} would exceed --host-memory")
            else:
                worse.append(f"{other} fits at equal time (tie-break)")
        if worse:
            text += ": " + "; ".join(worse)
        elif mode == FULL and len(ctx.modes) > 2:
            text += ": no cheaper mode of this layer saves bytes"
        lines.append(text)
    kept = [name for i, name in enumerate(profile.layer_names) if i not in best.checkpointed]
    if kept and len(ctx.modes) > 2:
        lines.append(f"kept ({len(kept)}): {short_list(kept)}: keeping costs nothing")
    modes_line = "layer modes considered: " + ", ".join(ctx.modes)
    missing = [m for m in MODES if m not in ctx.modes]
    if missing:
        modes_line += f" (not {', '.join(missing)}"
        modes_line += ": --modes)" if ctx.request.modes is not None else ")"
    lines.append(modes_line)
    lines.extend(barred_selective_reason(profile, bounds, best.times))
    return lines


def plan_warnings(ctx: SolveContext, best: PlanOption) -> list[str]:
    profile, request = ctx.profile, ctx.request
    b = best.micro_batch
    warnings = []
    if has_batchnorm(profile):
        warnings.append(
            f"the model has BatchNorm: its batch statistics are computed over each micro-batch "
            f"of {b}, not the effective batch of {request.target_batch}"
        )
        bn_layers = [
            profile.layers[i].name for i in best.checkpointed if profile.layers[i].has_batchnorm
        ]
        if bn_layers:
            warnings.append(
                f"BatchNorm running statistics update twice per step in checkpointed layers "
                f"({short_list(bn_layers)}): the recompute runs their forward again"
            )
    probed = profile.micro_batches
    largest = max(probed)
    if b > 4 * largest:
        warnings.append(
            f"micro-batch {b} is {b / largest:.0f}× the largest probed size ({largest}); the "
            f"model is validated to 4×: run `memplan verify` before relying on it"
        )
    if not min(probed) <= b <= largest:
        loose = [layer.name for layer in profile.layers if not layer.affine]
        if loose:
            warnings.append(
                f"layers {short_list(loose)} were not affine in the batch size when probed; "
                f"micro-batch {b} is outside the probed sizes, so their bytes are extrapolated"
            )
    if not profile.op_sequence_stable:
        one = (
            ", or micro-batch 1 taking its own path (a batch dimension of 1 skips copies): "
            "probe from 2 (--micro-batches 2,4,8) if the model routes nothing by data"
            if min(profile.micro_batches) == 1
            else ""
        )
        warnings.append(
            f"the {OP_SEQUENCE_DIFFERED} between probed sizes (data-dependent routing{one}): "
            f"verify the plan at micro-batch {b}"
        )
    capacity = (
        request.device_spec.memory_bytes
        if request.device_spec is not None
        else profile.environment.device_capacity_bytes
    )
    if capacity is not None and request.budget_bytes > capacity:
        warnings.append(
            f"the budget {format_bytes(request.budget_bytes)} exceeds the device's "
            f"{format_bytes(capacity)}"
        )
    if request.world_size > 1 and best.strategy == "zero2":
        warnings.append(
            "zero2 is modelled on DeepSpeed's documented behaviour (reduce bucket of "
            "reduce_bucket_size elements), not verified by memplan: run it under DeepSpeed "
            "and compare its memory report"
        )
    warnings.extend(f"profile: {message}" for message in _profile_warnings(profile, warnings))
    return warnings


def _profile_warnings(profile: Profile, said: Sequence[str]) -> list[str]:
    """The probe's warnings a plan repeats: not those the solver has already said in its
    own words for this plan (BatchNorm; bytes extrapolated from a non-affine layer; an op
    sequence that differed between probed sizes), so each warning appears once."""
    bn_said = any("BatchNorm" in w for w in said)
    extrapolated = any("extrapolated" in w for w in said)
    routing = any(OP_SEQUENCE_DIFFERED in w for w in said)
    kept = []
    for message in profile.warnings:
        if bn_said and "BatchNorm" in message:
            continue
        if extrapolated and "not affine" in message:
            continue
        if routing and OP_SEQUENCE_DIFFERED in message:
            continue
        kept.append(message)
    return kept


def target_reason(profile: Profile, device_spec: DeviceSpec | None) -> str | None:
    """What device the plan is for, when the profile and request name none: a meta profile
    probed without ``--device-profile`` plans tensor bytes alone (no CUDA reserve)."""
    if device_spec is not None or profile.environment.device != "meta":
        return None
    if profile.environment.device_profile:
        return None
    return (
        "planned for no particular device: tensor bytes only, without a GPU's CUDA context "
        "and allocator reserve (the meta profile names no device); pass --device-profile "
        "NAME to plan for that GPU"
    )
