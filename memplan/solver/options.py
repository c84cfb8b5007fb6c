"""One option of the search: a (strategy, micro-batch, grad sync) evaluated under the memory and
timing models, and the Plan built from it. No torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from memplan import host_link, memory, retime, timing
from memplan.collective import Collective
from memplan.errors import BadInputError
from memplan.memory import Peak, Reserve, Sharding
from memplan.modes import (
    FULL,
    KEEP,
    MODES,
    OFFLOAD,
    SELECTIVE,
)
from memplan.plan import GRAD_SYNCS, STRATEGIES, GradSync, ModelFingerprint, Plan, Prediction
from memplan.profile import Profile
from memplan.solver.layer_modes import least_cost_modes
from memplan.solver.layer_names import layer_names_of, short_list
from memplan.solver.request import SolveRequest
from memplan.timing import MicroStepTimes
from memplan.units import format_seconds


def has_batchnorm(profile: Profile) -> bool:
    return profile.has_batchnorm or any(layer.has_batchnorm for layer in profile.layers)


# --------------------------------------------------------------------------- modes
def resolve_modes(
    profile: Profile, request: SolveRequest, forced_in: frozenset[int]
) -> tuple[tuple[str, ...], float]:
    """The modes this solve may use and the host link's bytes per second (for offload).
    Default: keep and full always, selective when the probe measured it, offload when
    planning for CUDA with a known host link. Asked-for modes the profile or device cannot
    do are an error that says why."""
    cuda = memory.plans_for_cuda(profile, request.device_spec)
    link, link_source = host_link.host_link_bandwidth(request.device_spec)
    can = {KEEP: "", FULL: ""}
    why_not = {}
    if memory.has_selective(profile):
        can[SELECTIVE] = ""
    else:
        why_not[SELECTIVE] = (
            "the profile has no measurement of it (probed by an older memplan, or on meta)"
        )
    if not cuda:
        why_not[OFFLOAD] = "offload moves saved tensors to pinned host memory: CUDA only"
    elif link <= 0:
        why_not[OFFLOAD] = f"no host-link bandwidth to time it ({link_source})"
    else:
        can[OFFLOAD] = ""
    if request.modes is None:
        modes = tuple(m for m in MODES if m in can)
    else:
        bad = [m for m in request.modes if m not in can]
        if bad:
            raise BadInputError(
                f"--modes asks for {', '.join(bad)}, which this plan cannot use: "
                + "; ".join(f"{m}: {why_not[m]}" for m in bad)
                + ".",
                hint=f"Leave {', '.join(bad)} out of --modes"
                + (
                    ", or probe again with this memplan (on cpu or cuda)"
                    if SELECTIVE in bad
                    else ""
                )
                + (", or plan for a GPU (--device-profile NAME)" if OFFLOAD in bad else "")
                + ".",
            )
        modes = request.modes
    if forced_in and modes == (KEEP,):
        raise BadInputError(
            "always_checkpoint names layers, but --modes allows keep only.",
            hint="Add a checkpoint mode to --modes (e.g. keep,full).",
        )
    return modes, link


# --------------------------------------------------------------------------- evaluation
@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOption:
    """The best plan at one micro-batch and strategy (or, when none fits, the least peak)."""

    strategy: str
    micro_batch: int
    accumulation_steps: int
    allowed: bool
    fits: bool
    checkpointed: dict[int, str]
    """Layer index -> mode, for the layers not kept."""
    peak: Peak
    times: MicroStepTimes
    step_seconds: float
    """Communication included."""
    step_picoseconds: int
    comm_seconds: float
    """The collectives' time plus ``copy_seconds``."""
    comm_bytes: float
    grad_sync: GradSync = "last_micro_step"
    copy_seconds: float = 0.0
    """FSDP's copy-in and copy-out around its collectives (``timing.fsdp_copy_bytes``)."""
    accumulate_seconds: float = 0.0
    """FSDP's gradient accumulation over the micro-steps it does not reduce in
    (``fsdp_accumulate_bytes``): in ``step_seconds``, per micro-step, not in ``comm_seconds``."""
    within_host: bool = True
    """The checkpoint set offloads no more than ``--host-memory``; False only for an option
    that fits no budget and whose least peak needs more host memory than that (a layer
    forced to offload more than the host takes at this micro-batch)."""

    @property
    def rank(self) -> tuple[int, int, int, int, int]:
        return (
            self.step_picoseconds,
            STRATEGIES.index(self.strategy),
            len(self.checkpointed),
            -self.micro_batch,
            GRAD_SYNCS.index(self.grad_sync),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveContext:
    profile: Profile
    request: SolveRequest
    forced_in: frozenset[int]
    forced_out: frozenset[int]
    reserve: Reserve
    limit_bytes: int
    """Largest allocated peak that fits (budget less margin and reserve)."""
    ignore_budget: bool = False
    """Every option evaluated at its least peak (``limit_bytes`` is then -1)."""
    usable_bytes: int
    timing_source: timing.TimingSource
    bandwidth: float = timing.DEFAULT_INTERCONNECT_BYTES_PER_SECOND
    """Interconnect bytes per second for the communication time."""
    bandwidth_source: str = ""
    strategies: tuple[str, ...] = ("ddp",)
    modes: tuple[str, ...] = (KEEP, FULL)
    """Modes a layer may take in this solve."""
    host_link: float = 0.0
    """Host link bytes per second, for offload times (0: no offload)."""


def sharding_for(
    ctx: SolveContext, strategy: str, grad_sync: GradSync = "last_micro_step"
) -> Sharding:
    return Sharding(
        strategy=strategy,
        world_size=ctx.request.world_size,
        grad_sync=grad_sync,
        reshard_after_forward=ctx.request.reshard_after_forward,
        edge_units=ctx.request.edge_units,
        reduce_after_schedule=ctx.request.reduce_after_schedule,
    )


def _grad_syncs(strategy: str, accumulation: int, world: int) -> tuple[GradSync, ...]:
    """The ways a step may synchronise gradients: both for FSDP with accumulation."""
    if strategy == "fsdp" and accumulation > 1 and world > 1:
        return GRAD_SYNCS
    return ("last_micro_step",)


def bar_slow_selective(
    bounds: memory.StepBounds, times: MicroStepTimes, modes: tuple[str, ...]
) -> memory.StepBounds:
    """``bounds`` with selective not offered where it is no faster than full (when both
    are among ``modes``; memplan.timing.selective_slower_layers)."""
    if SELECTIVE not in modes or FULL not in modes:
        return bounds
    slower = timing.selective_slower_layers(times)
    if not slower:
        return bounds
    return dataclasses.replace(bounds, barred=frozenset((i, SELECTIVE) for i in slower))


def barred_selective_reason(
    profile: Profile, bounds: memory.StepBounds, times: MicroStepTimes
) -> list[str]:
    """The plan's reason line for the layers where selective was not offered."""
    slower = sorted(i for i, m in bounds.barred if m == SELECTIVE)
    if not slower:
        return []
    first = slower[0]
    return [
        f"selective not offered on {len(slower)} layer(s) "
        f"({short_list(layer_names_of(profile, slower))}): at micro-batch {bounds.micro_batch} the "
        f"probe measured it no faster than full recompute (e.g. {profile.layer_names[first]}: "
        f"+{format_seconds(times.mode_seconds(first, SELECTIVE))} against "
        f"+{format_seconds(times.mode_seconds(first, FULL))} per micro-step), and full "
        "frees more"
    ]


def _reserve_and_limit(
    ctx: SolveContext, sharding: Sharding, accumulation: int
) -> tuple[Reserve, int]:
    """The reserve of this strategy and accumulation, and the allocated limit it leaves.
    The solve's own (``ctx.reserve``) is the most sharded strategy's with one micro-step;
    FSDP2's reduce-scatter pool depends on both (``memory.fsdp_stream_bytes``)."""
    request = ctx.request
    reserve = memory.reserve_for(
        ctx.profile, request.device_spec, sharding, request.communicators, accumulation
    )
    if reserve == ctx.reserve or ctx.ignore_budget:
        return reserve, ctx.limit_bytes
    return reserve, memory.allocated_limit_bytes(request.budget_bytes, request.margin, reserve)


def fsdp_accumulate_bytes(
    probed_grads: int, reduced_grads: int, accumulation: int, world: int, every: bool
) -> float:
    """Bytes an FSDP2 rank reads and writes per step to accumulate gradients over
    ``accumulation`` micro-steps, beyond autograd's own in-place adds (which every engine's
    local accumulation has and no engine is charged). Reducing in every micro-step
    (``every``), ``foreach_reduce`` adds each later shard to the sharded gradient in the
    reduce dtype (``sharded_param.grad._local_tensor += new_sharded_grad``: read 2, write 1
    of ``reduced_grads / world``). Without (``set_requires_gradient_sync(False)``: a
    pipeline stage's every micro-batch, torch's ``PipelineStage``; the micro-steps before the
    last under ``last_micro_step``) and with a wider reduce dtype (``reduced_grads`` >
    ``probed_grads``: bf16 gradients, fp32 reduction), FSDP2 keeps an unsharded accumulator
    in it: ``to_accumulated_grad_if_needed`` copies the first micro-step's gradient (read G,
    write G32), ``accumulate_unsharded_grad_if_needed`` adds each later one (read G and G32,
    write G32) (torch/distributed/_composable/fsdp/_fsdp_param.py, the late-2024 FSDP2 of the
    published runs; torch 2.13 fsdp/_fully_shard/_fsdp_param.py and _fsdp_collectives.py).
    None in a probe's clock, which times one micro-step."""
    later = accumulation - 1
    if later <= 0:
        return 0.0
    if every:
        return later * 3 * reduced_grads / max(world, 1)
    if reduced_grads > probed_grads:
        return probed_grads + reduced_grads + later * (probed_grads + 2 * reduced_grads)
    return 0.0


def _evaluate(
    ctx: SolveContext,
    micro_batch: int,
    accumulation: int,
    allowed: bool,
    strategy: str = "ddp",
    grad_sync: GradSync = "last_micro_step",
) -> PlanOption:
    profile = ctx.profile
    sharding = sharding_for(ctx, strategy, grad_sync)
    bounds = memory.step_bounds(
        profile,
        micro_batch,
        accumulation,
        sharding,
        modes=ctx.modes,
        host_limit_bytes=ctx.request.host_memory_bytes,
    )
    times = retime.micro_step_times(
        profile, micro_batch, source=ctx.timing_source, device_spec=ctx.request.device_spec
    )
    times = timing.with_optimizer_share(
        times, sharding.world_size, sharding.strategy in ("zero1", "zero2", "fsdp")
    )
    if OFFLOAD in ctx.modes:
        times = timing.with_offload(
            times, host_link.offload_seconds(bounds.host_bytes, ctx.host_link)
        )
    costs = {mode: timing.mode_picoseconds(times, mode) for mode in ctx.modes if mode != KEEP}
    bounds = bar_slow_selective(bounds, times, ctx.modes)
    forced = {"forced_in": ctx.forced_in, "forced_out": ctx.forced_out}
    reserve, limit = _reserve_and_limit(ctx, sharding, accumulation)
    chosen = least_cost_modes(bounds, limit, costs, **forced)
    fits = chosen is not None
    if chosen is None:
        least = memory.min_allocated_bytes(bounds, **forced)
        chosen = least_cost_modes(bounds, least, costs, **forced)
        if chosen is None:  # the host limit binds there: the least peak within it
            chosen = _least_within_host(bounds, least, costs, forced)
        assert chosen is not None, "the least peak is reachable by definition"
    peak = memory.step_peak(
        profile, micro_batch, chosen, accumulation, reserve=reserve, sharding=sharding
    )
    collective = Collective(
        params_bytes=memory.gathered_params_bytes(profile),
        grads_bytes=memory.master_bytes(profile, sharding, memory.grads_bytes(profile)),
        accumulation_steps=accumulation,
        reduce_every_micro_step=memory.syncs_every_micro_step(sharding, accumulation),
        gathered_once=sharding.reduce_after_schedule and not sharding.reshard_after_forward,
    )
    comm_bytes = timing.communication_bytes(strategy, ctx.request.world_size, collective)
    copies = accumulate = 0.0
    if strategy == "fsdp":  # FSDP2's copy-in/copy-out around its collectives, memory-bound
        copy_bytes = timing.fsdp_copy_bytes(ctx.request.world_size, collective)
        copies = timing.fsdp_copy_seconds(copy_bytes, ctx.request.device_spec)
        held = fsdp_accumulate_bytes(
            memory.grads_bytes(profile),
            collective.grads_bytes,
            accumulation,
            ctx.request.world_size,
            collective.reduce_every_micro_step,
        )
        accumulate = timing.fsdp_copy_seconds(held, ctx.request.device_spec)
    comm = timing.communication_seconds(comm_bytes, ctx.bandwidth) + copies
    return PlanOption(
        strategy=strategy,
        micro_batch=micro_batch,
        accumulation_steps=accumulation,
        allowed=allowed,
        fits=fits,
        checkpointed=chosen,
        peak=peak,
        times=times,
        step_seconds=timing.step_seconds(times, accumulation, chosen) + comm + accumulate,
        step_picoseconds=timing.step_picoseconds(times, accumulation, chosen)
        + timing.to_picoseconds(comm)
        + timing.to_picoseconds(accumulate),
        comm_seconds=comm,
        comm_bytes=comm_bytes,
        grad_sync=grad_sync,
        copy_seconds=copies,
        accumulate_seconds=accumulate,
        within_host=bounds.host_limit_bytes is None
        or memory.host_total_bytes(bounds, chosen) <= bounds.host_limit_bytes,
    )


def _model_ref(profile: Profile, request: SolveRequest) -> str:
    if request.model_path:
        return request.model_path
    return profile.model.spec


def _device_label(profile: Profile, request: SolveRequest) -> str:
    if request.device:
        return request.device
    if request.device_spec is not None:
        return request.device_spec.name
    env = profile.environment
    if env.device == "meta" and env.device_profile:
        return env.device_profile
    return env.device


def build_plan(
    ctx: SolveContext, option: PlanOption, reasons: Sequence[str], warnings: Sequence[str]
) -> Plan:
    profile, request = ctx.profile, ctx.request
    names = profile.layer_names
    return Plan(
        target_batch=request.target_batch,
        micro_batch_size=option.micro_batch,
        accumulation_steps=option.accumulation_steps,
        world_size=request.world_size,
        strategy=option.strategy,
        checkpoint={names[i]: mode for i, mode in sorted(option.checkpointed.items())},
        shard_units=profile.layer_names if option.strategy == "fsdp" else (),
        shard_unit_types=tuple(dict.fromkeys(layer.module_type for layer in profile.layers))
        if option.strategy == "fsdp"
        else (),
        precision=profile.environment.precision,
        mixed_precision=profile.environment.mixed_precision,
        float8=profile.environment.float8,
        compiled=profile.environment.compiled,
        grad_sync=option.grad_sync,
        device=_device_label(profile, request),
        budget_bytes=request.budget_bytes,
        margin=request.margin,
        predicted=Prediction(
            peak_bytes=option.peak.peak_bytes,
            step_seconds=option.step_seconds,
            breakdown=option.peak.breakdown,
            peak_phase=option.peak.where,
        ),
        model=_model_ref(profile, request),
        model_fingerprint=ModelFingerprint(
            # as the model file builds them: fp32 masters when the probe cast to bf16
            parameter_bytes=memory.master_bytes(
                profile,
                sharding_for(ctx, option.strategy),
                profile.totals.params_trainable_bytes + profile.totals.params_frozen_bytes,
            ),
            candidate_layers=profile.layer_names,
            hf_blocks=profile.hf_blocks,
        ),
        profile=request.profile_path,
        reasons=tuple(reasons),
        warnings=tuple(warnings),
        seq_len=profile.seq_len,
    )


# --------------------------------------------------------------------------- strategies
def fsdp_measured(profile: Profile) -> bool:
    """Whether the profile measures what FSDP trains: its mixed-precision policy's bf16 or
    fp16 parameters (``--mixed-precision params``), or fp32 throughout; not autocast over
    fp32 parameters in a low precision, which is what single devices and DDP run."""
    env = profile.environment
    return env.mixed_precision == "params" or env.precision == "fp32"


def strategies_to_try(profile: Profile, request: SolveRequest) -> tuple[str, ...]:
    """The strategies to try. Low precision under sharding runs the engine's mixed-precision
    policy (FSDP2 ``MixedPrecisionPolicy``), which a profile measures only when probed with
    parameters in the compute dtype (``--mixed-precision params``); autocast over fp32
    parameters is what single devices and DDP run."""
    env = profile.environment
    world = request.world_size
    if world > 1 and profile.ddp_refused and request.strategy in ("ddp", "zero1"):
        raise BadInputError(
            f"Strategy {request.strategy} runs DDP on {world} ranks, and DDP cannot train "
            f"this model: {profile.ddp_refused}.",
            hint="Solve with --strategy fsdp (FSDP2 runs it: torchtitan's sharding and "
            "replication are FSDP2's).",
        )
    if env.mixed_precision == "params":
        single = world == 1 and request.strategy == "auto"
        if request.strategy not in ("fsdp", "auto") or single:
            raise BadInputError(
                f"The profile was probed with {env.precision} parameters (--mixed-precision "
                f"params), which is how FSDP's mixed-precision policy runs; strategy "
                f"{request.strategy if world > 1 else 'ddp'} on {world} rank(s) runs autocast "
                "over fp32 parameters instead.",
                hint=f"Solve with --strategy fsdp, or probe again with --precision "
                f"{env.precision} (autocast) for single-device and DDP plans.",
            )
        if world == 1:
            raise BadInputError(
                "FSDP's mixed-precision policy shards over ranks; this profile (probed with "
                "--mixed-precision params) plans --world-size 2 or more.",
                hint=f"Solve with --world-size N --strategy fsdp, or probe again with "
                f"--precision {env.precision} (autocast) for one device.",
            )
        return ("fsdp",)
    if request.strategy != "auto":
        if request.strategy == "fsdp" and not fsdp_measured(profile):
            raise BadInputError(
                f"The profile was probed under {env.precision} autocast over fp32 parameters; "
                "FSDP trains in low precision with its mixed-precision policy instead (bf16 "
                "parameters gathered one unit at a time, bf16 activations, fp32 master shards), "
                "whose memory that profile does not measure.",
                hint=f"Probe again with --precision {env.precision} --mixed-precision params "
                "and solve that profile with --strategy fsdp.",
            )
        return (request.strategy,)
    if world == 1:
        return ("ddp",)
    if profile.ddp_refused:  # DDP (and ZeRO-1 over it) cannot run it; ZeRO-2 not verified
        if env.precision != "fp32":
            raise BadInputError(
                f"DDP cannot train this model on {world} ranks ({profile.ddp_refused}), "
                f"and FSDP trains {env.precision} with its mixed-precision policy, which "
                f"this profile ({env.precision} autocast over fp32 parameters) does not "
                "measure.",
                hint=f"Probe again with --precision {env.precision} --mixed-precision params "
                "and solve that profile with --strategy fsdp.",
            )
        return ("fsdp",)
    if not fsdp_measured(profile):  # FSDP needs a profile probed with --mixed-precision params
        return tuple(st for st in STRATEGIES if st != "fsdp")
    return STRATEGIES


MANY_MICRO_BATCHES = 256
"""Above this many candidate micro-batches (a target like 897612484786617600 has 103,680
divisors) the search stops at the first one that does not fit."""


def _least_within_host(
    bounds: memory.StepBounds, least: int, costs: dict, forced: dict
) -> dict[int, str]:
    """The least-peak assignment within ``bounds.host_limit_bytes``, where the least peak
    of all (``least``) offloads more than the host takes: bisection on the limit (whether
    some assignment fits is monotone in it) up to the peak of any assignment within the
    host. Before, the host limit was dropped there, so a no-fit error's closest plan
    offloaded past ``--host-memory`` and its 'needs at least' figure was below what the
    host allows. Where no assignment stays within the host (a layer forced to offload
    more than it takes), the host limit is dropped, as before."""
    anything = least_cost_modes(bounds, 1 << 62, costs, **forced)
    if anything is None:
        anything = least_cost_modes(
            dataclasses.replace(bounds, host_limit_bytes=None), least, costs, **forced
        )
        assert anything is not None, "the least peak is reachable by definition"
        return anything
    lo, hi = least, memory.bounds_peak_bytes(bounds, anything)  # lo: none within the host
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if least_cost_modes(bounds, mid, costs, **forced) is None:
            lo = mid
        else:
            hi = mid
    chosen = least_cost_modes(bounds, hi, costs, **forced)
    assert chosen is not None, "feasible at hi by the bisection"
    return chosen


def evaluate_micro_batches(
    ctx: SolveContext, micro_batches: list[int], per_rank: int, bn_floor: int | None, strategy: str
) -> list[PlanOption]:
    """Every candidate micro-batch of ``strategy``; for very many, ascending until the first
    that does not fit even with its best checkpoint set — a larger micro-batch with
    accumulation holds more activations, so it cannot fit either — plus ``per_rank`` itself
    (accumulation 1, whose gradients are never resident with activations)."""
    options = []
    world = ctx.request.world_size
    for b in micro_batches:
        mine = [
            _evaluate(
                ctx,
                b,
                per_rank // b,
                allowed=bn_floor is None or b >= bn_floor,
                strategy=strategy,
                grad_sync=sync,
            )
            for sync in _grad_syncs(strategy, per_rank // b, world)
        ]
        options.extend(mine)
        fits = any(option.fits for option in mine)
        if len(micro_batches) > MANY_MICRO_BATCHES and not fits and b != per_rank:
            if micro_batches[-1] == per_rank:
                last = micro_batches[-1]
                options.append(
                    _evaluate(
                        ctx,
                        last,
                        1,
                        allowed=bn_floor is None or last >= bn_floor,
                        strategy=strategy,
                    )
                )
            break
    return options
