"""The layout search (issue 25): tensor, pipeline and context parallel degrees with the data-
parallel model, jointly with micro-batch, pipeline micro-batches and per-layer modes. No torch.

For each layout (fixed by ``--tp/--pp/--cp``, or every factorisation of the world size with
``tp`` within a node, ``pp`` at most the block count, ``cp`` as asked) and each micro-batch
``b`` with ``b · m · dp == target``, every pipeline stage's rank is solved exactly as a
data-parallel profile of its own (``memory.layout.rank_profile``; the existing solver over
its checkpoint modes at that ``b`` and ``m``). The layout fits when every stage fits. Its
step time is the slowest stage's, through the pipeline schedule, plus what the layout's
collectives add, none of them overlapped (an upper bound, as for data parallelism)::

    step     = (m + pp − 1)/m · (max_s t_s + c_TP + c_PP + c_CP)  +  max_s o_s  (+ DDP's)
    bubble   = (pp − 1) / (m + pp − 1)                      (1F1B, GPipe; / v interleaved)
    c_TP     = m · (4·L_s + 2·F_s) · ring(b · act_bytes, tp) / intra   (2 all-reduces
               forward and 2 backward per block, Megatron's f/g operators; SP's all-gather
               + reduce-scatter move the same bytes; the F_s fully checkpointed blocks run
               the forward's 2 again in their recompute)
    c_PP     = m · 2v · b · act_bytes (/ tp under SP) / inter   (an activation and its
               gradient across each of a rank's v stage boundaries per micro-batch)
    c_CP     = m · (L_s · (g_f + g_b) + F_s · g_f)   (ring attention's K/V, dK/dV exchanges,
               memplan.solver.ring: NCCL's NVLink within a node, 50 GB/s once tp·cp leaves it)
    ring(x, n) = 2 (n − 1) / n · x

(``layout_time``: the bubble stretches each micro-batch's collectives with its compute;
before, they were added once, outside it), with ``t_s`` stage s's micro-batches (compute and
recompute, a TP rank's split GEMMs at its own shapes, memplan.solver.tp_gemms; with CP also
the ring's memory-bound merges, memplan.solver.ring), ``o_s`` what it runs once per step (optimizer step; data-parallel collectives at
``data_parallel_bandwidth``: NVLink within a node, the group's NICs between nodes), both from
the stage solve, ``act_bytes`` one sample's block input and ``intra`` the device's NVLink at
NCCL's bus bandwidth. The fastest fitting plan wins (ties: less peak). Unknown without a
GPU: the collectives' overlap with compute, kernel efficiency at small per-rank shapes, the
real network; so close layouts rank by a model's figures (the reasons say by how much).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memplan import timing
from memplan.devices import DeviceSpec
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.memory.edge_units import edge_refusal
from memplan.memory.parallel import (
    check_layout,
    communicators,
    layout_sharding,
    loss_parallel_possible,
    own_checkpoint,
    rank_profile,
    stage_peak,
    tp_measured,
)
from memplan.modes import FULL, SELECTIVE
from memplan.parallel import Parallel, in_flight, pipeline_refusal_by_kind, split_fits
from memplan.plan import Plan
from memplan.profile import Profile
from memplan.solver.batches import divisors, micro_batch_sizes, split_error
from memplan.solver.layer_names import forced_layers, on_stage
from memplan.solver.layout_explain import ONE_SHARD, layout_reasons, no_layout_hint, one_shard
from memplan.solver.layout_time import (  # re-exported: the layout search's time terms
    INTER_NODE_BYTES_PER_SECOND,
    bubble_fraction,
    data_parallel_bandwidth,
    intra_node_bandwidth,
    layout_comm_seconds,
    pipeline_seconds,
)
from memplan.solver.options import MANY_MICRO_BATCHES, fsdp_measured
from memplan.solver.request import LayoutOption, LayoutRequest, SolveRequest, SolveResult
from memplan.solver.ring import ring_seconds
from memplan.solver.search import solve_if_fits
from memplan.solver.tp_gemms import gemm_spec, rank_gemms_profile
from memplan.units import format_bytes


def candidate_layouts(
    profile: Profile,
    world: int,
    ask: LayoutRequest,
    strategy: str = "fsdp",
    why: list[tuple[str, str]] | None = None,
) -> list[Parallel]:
    """Every layout to consider: fixed degrees as given, the rest searched (``auto``) or 1.
    The data-parallel ranks are DDP replicas for ``ddp``, shards otherwise. ``why``
    collects, for each combination of degrees left out, the kind of reason and the reason."""
    skipped = why if why is not None else []
    n = len(profile.layers)
    every = divisors(world) if ask.auto else [1]  # by factorisation: a prime world is quick
    tps = [ask.tp] if ask.tp else [t for t in every if t <= ask.gpus_per_node]
    # memplan runs pipeline stages of Hugging Face decoders only: the probe's verdict where
    # recorded (pipeline_refused, below), else the model's kind (memplan.parallel)
    split = pipeline_refusal_by_kind(profile.model.spec, profile.hf_blocks) is None
    pps = [ask.pp] if ask.pp else [p for p in every if p == 1 or (split and p <= n)]
    cps = [ask.cp] if ask.cp else [1]
    out = []
    for tp in tps:
        for pp in pps:
            for cp in cps:
                degrees = f"tp {tp} × pp {pp} × cp {cp}"
                if world % (tp * pp * cp):
                    skipped.append(("divide", f"{degrees} does not divide {world} ranks"))
                    continue
                if pp > 1 and not split_fits(n, pp * ask.virtual_stages, ask.stage_split):
                    stages = pp * ask.virtual_stages  # every stage of every rank
                    skipped.append(
                        ("split", f"{n} blocks do not split into {stages} stages as asked")
                    )
                    continue
                if tp > 1 and not tp_measured(profile):
                    skipped.append(("tp", "the profile has no TP measurement"))
                    continue
                if pp > 1 and profile.pipeline_refused:
                    skipped.append(("stages", f"pipeline stages: {profile.pipeline_refused}"))
                    continue  # the model cannot be split into stages memplan runs
                if tp > 1 and profile.tp_degree_divides and profile.tp_degree_divides % tp:
                    skipped.append(
                        ("heads", f"tp {tp} does not divide {profile.tp_degree_divides}")
                    )
                    continue  # it would split a head or a projection unevenly
                dp = world // (tp * pp * cp)
                replicas = strategy == "ddp"
                shards = dp if replicas else dp * cp  # FSDP spans cp (layout_sharding)
                if profile.environment.mixed_precision == "params" and shards < 2:
                    skipped.append((ONE_SHARD, one_shard(profile, degrees, shards)))
                    continue  # FSDP's mixed-precision policy, as probed, needs shards
                sp = ask.sequence_parallel
                if sp is None:  # the runtime runs SP without pipeline stages only
                    sp = ask.auto and tp > 1 and pp == 1
                lp = ask.loss_parallel is not False and tp > 1
                out.append(
                    Parallel(
                        dp_replicate=dp if replicas else 1,
                        dp_shard=1 if replicas else dp,
                        tp=tp,
                        pp=pp,
                        cp=cp,
                        sequence_parallel=sp and tp > 1,
                        schedule=ask.schedule if pp > 1 else "1f1b",
                        virtual_stages=ask.virtual_stages if pp > 1 else 1,
                        loss_parallel=lp and loss_parallel_possible(profile),
                        kept_outputs=ask.kept_outputs if pp > 1 else "none",
                        stage_split=ask.stage_split if pp > 1 else "memplan",
                        fsdp_units=ask.fsdp_units if pp == 1 and not replicas else "memplan",
                    )
                )
    return out


_RANKS: dict[tuple, Profile] = {}
_RANKS_OF: list[Profile] = []
"""The profile ``_RANKS`` belongs to, held so that its identity cannot pass to another
profile (an ``id`` alone can be reused once the first is collected)."""


def _rank_profile(
    profile: Profile,
    parallel: Parallel,
    stage: int,
    m: int,
    all_full: bool = False,
    spec: DeviceSpec | None = None,
) -> Profile:
    """``rank_profile``, which depends on the micro-batches only through the stage's
    in-flight count: kept for the search of one profile (the last one asked). ``all_full``:
    every block of the stage fully checkpointed, in the waiting micro-batches too. Its split
    GEMMs timed at its own shapes on ``gemm_spec(profile, spec)`` (solver.tp_gemms)."""
    if not _RANKS_OF or _RANKS_OF[0] is not profile:
        _RANKS.clear()
        _RANKS_OF[:] = [profile]
    k = in_flight(parallel, stage, m)
    key = (parallel, stage, k, min(k, m - 1), all_full)  # memory.parallel's two phases
    if key not in _RANKS:
        modes = None
        if all_full:
            names = rank_profile(profile, parallel, stage, m).layer_names
            modes = dict.fromkeys(names, "full")
        _RANKS[key] = rank_profile(profile, parallel, stage, m, modes)
    spec = gemm_spec(profile, spec)
    if spec is None or parallel.tp == 1:
        return _RANKS[key]
    timed = (*key, spec)  # a spec by its values: equal specs time alike
    if timed not in _RANKS:
        _RANKS[timed] = rank_gemms_profile(_RANKS[key], parallel, spec)
    return _RANKS[timed]


def _all_full_variant(
    profile: Profile, request: SolveRequest, parallel: Parallel, stage: int, m: int
) -> tuple[Profile, SolveRequest] | None:
    """With pipeline stages and ``full`` allowed: the stage's rank with every block fully
    checkpointed in every micro-batch in flight, and the request pinning that map."""
    if parallel.pp == 1 or (request.modes is not None and "full" not in request.modes):
        return None
    if request.never_checkpoint:  # (cut to the stage) a block it may not checkpoint
        return None
    spec = request.device_spec
    rank_full = _rank_profile(profile, parallel, stage, m, all_full=True, spec=spec)
    if not rank_full.layers:
        return None
    forced = dataclasses.replace(
        request, always_checkpoint=rank_full.layer_names, never_checkpoint=(), modes=("full",)
    )
    return rank_full, forced


def _solve_stage(
    profile: Profile, request: SolveRequest, parallel: Parallel, stage: int, m: int
) -> SolveResult | None:
    """The stage's rank solved exactly over its modes, with waiting micro-batches charged
    as ``rank_profile`` charges them without a map; and, with pipeline stages, once more
    with every block fully checkpointed in every micro-batch in flight (what the stage
    then holds, exactly): the faster that fits."""
    rank = _rank_profile(profile, parallel, stage, m, spec=request.device_spec)
    request = on_stage(request, rank.layer_names)
    result = solve_if_fits(rank, request, explain=False)
    variant = _all_full_variant(profile, request, parallel, stage, m)
    if variant is None:
        return result
    full = solve_if_fits(*variant, explain=False)
    if full is None:
        return result
    if result is None or full.plan.predicted.step_seconds <= result.plan.predicted.step_seconds:
        return full
    return result


def _searched_strategy(request: SolveRequest, profile: Profile) -> str:
    """The strategy the layouts are searched for: as asked; ``auto`` as FSDP, but as DDP
    for a profile probed under bf16 or fp16 autocast over fp32 parameters, whose memory
    under FSDP's mixed-precision policy it does not measure (memplan.solver.options.
    strategies_to_try; before, ``--layout auto --strategy auto`` refused such a profile
    outright)."""
    if request.strategy != "auto":
        return request.strategy
    return "fsdp" if fsdp_measured(profile) else "ddp"


def _strategy(request: SolveRequest, parallel: Parallel) -> str:
    """The data-parallel engine: as asked; ``auto`` shards (FSDP2 over dp × cp, as torchtitan)."""
    if request.strategy != "auto":
        return request.strategy
    return "fsdp" if parallel.dp_shard * parallel.cp > 1 else "ddp"


def _stage_request(
    request: SolveRequest, parallel: Parallel, b: int, m: int, gpus_per_node: int = 8
) -> SolveRequest:
    """What each stage's rank is solved for: micro-batch ``b``, ``m`` micro-batches, the
    data-parallel dimension exactly as the memory model takes it (``layout_sharding``: a
    pipeline's DDP replicas are all-reduced after the schedule, no buckets, world 1 to the
    stage solve; their all-reduce is timed with the layout's own collectives), its
    bandwidth (``data_parallel_bandwidth``), and the reserve's NCCL communicators of the
    whole layout (``communicators``), as the plan's peak (``stage_peak``) counts them."""
    strategy = _strategy(request, parallel)
    sharding = layout_sharding(strategy, parallel)
    intra, _ = timing.interconnect_bandwidth(request.device_spec)
    bandwidth = data_parallel_bandwidth(parallel, intra, gpus_per_node, strategy != "ddp")
    return dataclasses.replace(
        request,
        target_batch=b * m * sharding.world_size,
        world_size=sharding.world_size,
        strategy=strategy,
        min_micro=b,
        max_micro=b,
        reshard_after_forward=sharding.reshard_after_forward,
        edge_units=sharding.edge_units,
        reduce_after_schedule=sharding.reduce_after_schedule,
        communicators=communicators(parallel),
        data_parallel_bandwidth=bandwidth,
    )


def evaluate_layout(
    profile: Profile,
    request: SolveRequest,
    parallel: Parallel,
    b: int,
    m: int,
    gpus_per_node: int = 8,
) -> LayoutOption | None:
    """Solve every stage of ``parallel`` at micro-batch ``b`` with ``m`` micro-batches; None
    when a stage does not fit."""
    stage_request = _stage_request(request, parallel, b, m, gpus_per_node)
    world = stage_request.world_size
    results = []
    most_layers = 0
    # Stage 0 holds the most micro-batches in flight: the likeliest not to fit, tried first.
    for stage in range(parallel.pp):
        rank = _rank_profile(profile, parallel, stage, m)  # its block count only
        most_layers = max(most_layers, len(rank.layers))
        result = _solve_stage(profile, stage_request, parallel, stage, m)
        if result is None:
            return None
        results.append(result)
    # the bubble stretches the micro-batches' part; the optimizer and DP collectives run once
    slowest = max(r.plan.predicted.step_seconds - r.once_seconds for r in results)
    once = max(r.once_seconds for r in results)

    # a checkpointed block runs (some of) its forward's TP collectives again in its recompute
    def most_in(kind: str) -> int:  # the most blocks any stage checkpoints in mode ``kind``
        return max(sum(1 for mode in r.plan.checkpoint.values() if mode == kind) for r in results)

    recomputed, selective = most_in(FULL), most_in(SELECTIVE)
    intra = intra_node_bandwidth(request.device_spec)
    ring = ring_seconds(profile, parallel, b, request.device_spec, gpus_per_node, intra)
    per_micro = layout_comm_seconds(
        profile,
        parallel,
        b,
        m,
        most_layers,
        recomputed,
        intra,
        ring.comm(most_layers, recomputed),
        selective,
    )
    slowest += m * ring.memory(most_layers, recomputed)  # the ring's merges: stage compute
    # the bubble stretches each micro-batch's collectives with its compute (layout_time)
    micro, comm = pipeline_seconds(parallel, m, slowest, per_micro)
    if world == 1 and parallel.dp > 1:  # the pipeline's replicas, all-reduced after the step
        grads = profile.totals.grad_bytes / (parallel.pp * parallel.tp)
        bandwidth = stage_request.data_parallel_bandwidth or INTER_NODE_BYTES_PER_SECOND
        comm["dp"] = 2 * timing.ring_fraction(parallel.dp) * grads / bandwidth
    bubble = bubble_fraction(parallel, m)
    step = micro + once + sum(comm.values())
    return LayoutOption(
        parallel=parallel,
        micro_batch=b,
        micro_batches=m,
        stages=tuple(results),
        step_seconds=step,
        comm_seconds=comm,
        bubble=bubble,
    )


def _options(profile: Profile, request: SolveRequest, ask: LayoutRequest) -> list[LayoutOption]:
    world = request.world_size
    strategy = _searched_strategy(request, profile)
    divides = profile.tp_degree_divides
    if ask.tp and ask.tp > 1 and divides and divides % ask.tp:
        raise BadInputError(
            f"--tp {ask.tp} would split the model's attention heads or a projection unevenly: "
            f"its TP degree must divide {divides} (the heads, key/value heads and split "
            "dimensions have that greatest common divisor).",
            hint=f"Choose --tp from {', '.join(map(str, divisors(divides)))}.",
        )
    if (ask.tp or 1) > 1 or (ask.pp or 1) > 1:  # a fixed degree the model cannot run
        check_layout(profile, Parallel(tp=ask.tp or 1, pp=ask.pp or 1))
    if (
        ask.pp
        and ask.pp > 1
        and (why := pipeline_refusal_by_kind(profile.model.spec, profile.hf_blocks))
    ):
        raise BadInputError(f"--pp {ask.pp}: {why}.", hint="Plan this model with --pp 1.")
    why: list[tuple[str, str]] = []
    layouts = candidate_layouts(profile, world, ask, strategy, why)
    if not layouts:
        searched = "auto" if ask.auto else 1
        reasons = "; ".join(dict.fromkeys(text for _, text in why)) or (
            f"no tp up to --gpus-per-node {ask.gpus_per_node} was asked or searched"
        )
        raise BadInputError(
            f"no layout of {world} ranks fits the asked degrees (tp {ask.tp or searched}, pp "
            f"{ask.pp or searched}, cp {ask.cp or 1}) and the model's {len(profile.layers)} "
            f"blocks: {reasons}.",
            hint=None
            if why and all(kind == ONE_SHARD for kind, _ in why)
            else "Make the degrees divide --world-size, keep tp within --gpus-per-node, "
            "and pp at most the number of blocks.",
        )
    for parallel in layouts:
        check_layout(profile, parallel)
    options = []
    splits = 0
    for parallel in layouts:
        pairs = _splits(request, parallel)
        splits += len(pairs)
        for b, m in pairs:
            option = evaluate_layout(profile, request, parallel, b, m, ask.gpus_per_node)
            if option is not None:
                options.append(option)
            elif len(pairs) > MANY_MICRO_BATCHES and parallel.schedule != "gpipe":
                # As the data-parallel search does for very many micro-batches: the in-flight
                # count is capped (1F1B), so a larger micro-batch holds more and cannot fit;
                # without stages, accumulation 1 (no gradients resident) is still tried.
                last_b, last_m = pairs[-1]
                if parallel.pp == 1 and last_m == 1 and last_b != b:
                    option = evaluate_layout(
                        profile, request, parallel, last_b, last_m, ask.gpus_per_node
                    )
                    options.extend([option] if option is not None else [])
                break
    if not splits:
        target, lo, hi = request.target_batch, request.min_micro, request.max_micro
        assert target is not None
        dps = sorted({p.dp for p in layouts})
        raise split_error(
            target,
            dps[0],
            lo,
            hi,
            f"no layout of {world} ranks splits it: data-parallel degree "
            f"{' or '.join(map(str, dps))}, with at least pp micro-batches per step "
            "(a multiple of pp when interleaved)",
        )
    return options


def _splits(request: SolveRequest, parallel: Parallel) -> list[tuple[int, int]]:
    """Every (micro-batch, pipeline micro-batches) of the target on ``parallel``: ``b`` a
    divisor of the target per data-parallel rank (by factorisation, so a target of 10^11
    is quick), within [min_micro, max_micro]; a pipeline needs at least ``pp``
    micro-batches (torch's 1F1B schedules), a multiple of ``pp`` when interleaved."""
    target = request.target_batch
    assert target is not None
    if target % parallel.dp:
        return []
    per_dp = target // parallel.dp
    out = []
    for b in micro_batch_sizes(per_dp, 1, request.min_micro, request.max_micro):
        m = per_dp // b
        if parallel.pp > 1 and (
            m < parallel.pp or (parallel.virtual_stages > 1 and m % parallel.pp)
        ):
            continue  # torch's 1F1B schedules need at least pp micro-batches
        out.append((b, m))
    return out


def _least_stage_peak(
    profile: Profile, request: SolveRequest, parallel: Parallel, stage: int, m: int
) -> int:
    """A stage's least peak as ``_solve_stage`` solves it: with pipeline stages also with
    every block fully checkpointed in every micro-batch in flight (the rank profile without
    a map charges waiting micro-batches their un-checkpointed bytes)."""
    from memplan.solver.search import least_peak_bytes

    rank = _rank_profile(profile, parallel, stage, m, spec=request.device_spec)  # _solve_stage's
    request = on_stage(request, rank.layer_names)
    least = least_peak_bytes(rank, request)
    variant = _all_full_variant(profile, request, parallel, stage, m)
    return least if variant is None else min(least, least_peak_bytes(*variant))


def least_layout_peak(
    profile: Profile, request: SolveRequest, ask: LayoutRequest
) -> tuple[int, Parallel, int] | None:
    """The least per-rank peak any of the asked layouts needs at the target batch (each
    stage at its least-memory plan, the layout at its worst stage), with that layout and
    micro-batch; None when no layout runs the target at all."""
    strategy = _searched_strategy(request, profile)
    best: tuple[int, Parallel, int] | None = None
    for parallel in candidate_layouts(profile, request.world_size, ask, strategy):
        for b, m in _splits(request, parallel):
            stage_request = _stage_request(request, parallel, b, m, ask.gpus_per_node)
            peak = max(
                _least_stage_peak(profile, stage_request, parallel, stage, m)
                for stage in range(parallel.pp)
            )
            if best is None or peak < best[0]:
                best = (peak, parallel, b)
    return best


def layout_plan(
    profile: Profile,
    option: LayoutOption,
    reasons: list[str],
    device_spec: DeviceSpec | None = None,
) -> Plan:
    """One plan of the layout: every stage's checkpoint modes, the worst rank's prediction
    with the layout's step time. With pipeline stages each stage's peak is evaluated again
    for the plan's own checkpoint map (``memory.parallel.stage_peak``: waiting micro-batches
    keep what their modes keep), which the search charged at most that much, so the plan
    says what ``verify`` compares with."""
    worst = option.stages[option.worst_stage].plan
    checkpoint = {}
    for index, stage in enumerate(option.stages):  # each rank's own blocks (interleaving)
        checkpoint.update(own_checkpoint(profile, option.parallel, index, stage.plan.checkpoint))
    order = {name: i for i, name in enumerate(profile.layer_names)}
    checkpoint = dict(sorted(checkpoint.items(), key=lambda kv: order[kv[0]]))
    fingerprint = worst.model_fingerprint
    if fingerprint is not None:
        from memplan.memory.terms import params_bytes

        fingerprint = dataclasses.replace(
            fingerprint,
            parameter_bytes=params_bytes(profile) - profile.totals.buffer_bytes,
            candidate_layers=profile.layer_names,
        )
    p = option.parallel
    plan = dataclasses.replace(
        worst,
        target_batch=option.micro_batch * option.micro_batches * p.dp,
        world_size=p.world_size,
        accumulation_steps=option.micro_batches,
        parallel=p,
        checkpoint=checkpoint,
        shard_units=profile.layer_names if worst.strategy == "fsdp" else (),
        model_fingerprint=fingerprint,
        predicted=dataclasses.replace(
            worst.predicted,
            step_seconds=option.step_seconds,
            stage_peak_bytes=tuple(s.plan.predicted.peak_bytes for s in option.stages)
            if p.pp > 1
            else (),
        ),
        reasons=(*reasons, *worst.reasons),
    )
    if p.pp == 1:
        return plan
    peaks = [stage_peak(profile, plan, s, device_spec).peak for s in range(p.pp)]
    top = max(peaks, key=lambda peak: peak.peak_bytes)
    return dataclasses.replace(
        plan,
        predicted=dataclasses.replace(
            plan.predicted,
            peak_bytes=top.peak_bytes,
            breakdown=top.breakdown,
            peak_phase=top.where,
            stage_peak_bytes=tuple(peak.peak_bytes for peak in peaks),
        ),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutResult:
    plan: Plan
    options: tuple[LayoutOption, ...]
    """Every layout and micro-batch that fits."""


def solve_layout(profile: Profile, request: SolveRequest, ask: LayoutRequest) -> LayoutResult:
    """The fastest fitting layout plan for ``request`` (its ``world_size`` is all ranks).
    Raises NoPlanFitsError when no layout fits."""
    notes = []
    if request.strategy == "ddp" and profile.environment.mixed_precision == "params":
        # The CLI's default; a profile probed under FSDP's mixed-precision policy plans FSDP.
        request = dataclasses.replace(request, strategy="fsdp")
        notes.append(
            "strategy fsdp: the profile was probed under FSDP's mixed-precision policy "
            "(--mixed-precision params), which DDP does not run"
        )
    if ask.fsdp_units != "memplan" and request.strategy != "fsdp":
        raise BadInputError(
            f"--fsdp-units {ask.fsdp_units} says how FSDP groups the parameters outside the "
            f"blocks, but this plan's strategy is {request.strategy}, which has no FSDP units.",
            hint="Add --strategy fsdp, or drop --fsdp-units.",
        )
    refusal = edge_refusal(profile) if ask.fsdp_units != "memplan" else None
    if refusal is not None:
        raise BadInputError(
            refusal,
            hint="Plan with --fsdp-units memplan (one root unit, whole all step: never less "
            "than torchtitan holds), or name the embeddings' module with one of those words.",
        )
    forced_layers(profile, request)  # names and globs checked once, against every block
    options = _options(profile, request, ask)
    if not options:
        strategy = _searched_strategy(request, profile)
        layouts = candidate_layouts(profile, request.world_size, ask, strategy)
        least = least_layout_peak(profile, request, ask)
        needs = (
            f" The least peak any of them needs is {format_bytes(least[0])} per rank "
            f"({least[1].describe()}, micro-batch {least[2]})."
            if least
            else ""
        )
        world, target = request.world_size, request.target_batch or request.world_size
        smaller = least_layout_peak(profile, dataclasses.replace(request, target_batch=world), ask)
        twice = dataclasses.replace(request, world_size=2 * world, target_batch=2 * target)
        more = least_layout_peak(profile, twice, ask)
        raise NoPlanFitsError(
            f"no layout of {request.world_size} ranks fits {format_bytes(request.budget_bytes)} "
            f"per rank at target batch {request.target_batch}.{needs}",
            hint=no_layout_hint(
                profile,
                request,
                ask,
                layouts,
                least=least,
                smaller=smaller,
                more=more,
                strategy=strategy,
            ),
            min_peak_bytes=least[0] if least else None,
        )
    best = min(options, key=lambda o: (o.step_seconds, o.peak_bytes))
    return LayoutResult(
        plan=layout_plan(
            profile, best, [*layout_reasons(best, options), *notes], request.device_spec
        ),
        options=tuple(options),
    )
