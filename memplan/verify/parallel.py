"""One rank of ``memplan verify --world-size N`` for a plan with a parallel layout
(issue 25): the model built with the same seed on every rank, checkpointed as the plan
says, parallelised by memplan.run.parallel (TP on a CPU device mesh with DTensor, pipeline
stages with torch.distributed.pipelining, DDP or FSDP2 over the data-parallel ranks), then
1 + ``steps`` optimizer steps under the distributed tracker. Ranks of one TP group and one
pipeline see the same samples; data-parallel ranks different ones.

The gradient check runs the layout once more with lr 0 and compares each parameter's
gradient on this rank (its TP shard, its stage's layers) with a single process's gradient
of the whole dp × k × micro batch, sliced to the same shard."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from memplan.model.batch import cut_batch
from memplan.parallel import Parallel
from memplan.plan import Plan
from memplan.probe.session import users_backward
from memplan.probe.tracker import resident_tensors
from memplan.verify.plan_check import micro_rows


def _zero1_rank_predictions(plan: Plan, device: str, world: int) -> tuple[int, ...]:
    """Each ZeRO-1 rank's predicted peak: the plan's is its fullest rank's, and a rank
    ZeroRedundancyOptimizer gives less state holds that much less all step
    (``memory.sharding.zero1_rank_state_bytes``, from the profile the plan was solved from).
    Before, every rank was compared with the fullest's: a model whose head holds 85% of the
    weights measured 38% under it on the other rank, a false FAIL. Empty where the profile
    is not to hand (every rank is then compared with the plan's)."""
    from pathlib import Path

    from memplan.errors import MemplanError
    from memplan.memory.sharding import sharding_for, zero1_rank_state_bytes
    from memplan.profile import load_profile
    from memplan.verify.single import predicted_for_device

    if not plan.profile or not Path(plan.profile).is_file():
        return ()
    try:
        states = zero1_rank_state_bytes(load_profile(plan.profile), sharding_for(plan))
    except (MemplanError, ValueError):
        return ()
    if len(states) != world:
        return ()
    fullest = predicted_for_device(plan, device)[0]
    return tuple(fullest - (max(states) - state) for state in states)


def rank_predictions(plan: Plan, device: str, world: int) -> tuple[int, ...]:
    """Each rank's predicted peak under a pipeline layout (a rank's stage's peak, from the
    plan's ``predicted.stage_peak_bytes`` or, without it, from the profile the plan was
    solved from), as ``predicted_for_device`` adjusts it for ``device``; empty when every
    rank has the plan's prediction (no pipeline, or no per-stage figures to be had)."""
    from memplan.memory.parallel import stage_of_rank

    layout = plan.parallel
    if plan.strategy == "zero1" and (layout is None or layout.pp == 1):
        return _zero1_rank_predictions(plan, device, world)
    if layout is None or layout.pp == 1:
        return ()
    reserve = 0 if device == "cuda" else plan.predicted.breakdown.reserve
    stages = tuple(getattr(plan.predicted, "stage_peak_bytes", ()) or ())
    if len(stages) == layout.pp:
        return tuple(stages[stage_of_rank(layout, r)] - reserve for r in range(world))
    from dataclasses import replace
    from pathlib import Path

    from memplan.errors import MemplanError
    from memplan.memory.parallel import layout_peaks
    from memplan.profile import load_profile

    if not plan.profile or not Path(plan.profile).is_file():
        return ()  # no profile to hand: every rank is compared with the worst stage's
    try:
        peaks = layout_peaks(load_profile(plan.profile), replace(plan, parallel=layout))
    except (MemplanError, ValueError):
        return ()
    return tuple(
        peaks.rank_peak(r).allocated_bytes if device != "cuda" else peaks.rank_peak(r).peak_bytes
        for r in range(world)
    )


def _batches(mf: Any, micro: int, k: int) -> list[Any]:
    return [mf.make_batch(micro) for _ in range(k)]


def run_layout_rank(
    rank: int, config: dict[str, Any], plan: Plan, parallel: Parallel, tracker: Any
) -> dict:
    """Measure this rank's peak under ``parallel`` with ``tracker`` (a fresh
    memplan.verify.distributed.DistributedTracker); the dict ``_run_rank`` returns."""
    from memplan import run
    from memplan.model.loader import load_model_file
    from memplan.run.parallel import build_layout, data_rank
    from memplan.verify.single import fingerprint_note

    device = torch.device("cpu")
    mf = load_model_file(config["model"]).at_seq_len(plan.seq_len)
    micro, k, seed = plan.micro_batch_size, plan.accumulation_steps, int(config["seed"])
    torch.manual_seed(seed)
    net = mf.build_model().to(device).train()
    fingerprint_note(plan, net, str(config["model"]))
    run.apply(net, plan)
    tracker.track(resident_tensors(net, None, None))
    declared = getattr(mf.module, "TP_PLAN", None)
    with tracker:
        layout = build_layout(
            net, plan, parallel, mf.make_optimizer, device, declared_tp_plan=declared
        )
    torch.manual_seed(seed + 1 + data_rank(parallel, rank))
    tracker.peak_bytes = tracker.live_bytes
    effective = micro * k * parallel.dp
    with tracker:
        for _ in range(config["steps"] + 1):
            layout.train_step(_batches(mf, micro, k), mf.loss)
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(config["steps"]):
        layout.train_step(_batches(mf, micro, k), mf.loss)
    seconds = (time.perf_counter() - start) / config["steps"]
    out: dict[str, Any] = {
        "rank": rank,
        "peak_bytes": int(tracker.peak_bytes),
        "tracker_peak_bytes": int(tracker.peak_bytes),
        "step_seconds": seconds,
        "effective_batch": effective,
        "cuda_max_allocated_bytes": None,
        "cuda_max_reserved_bytes": None,
        "timeline": (),
        "timeline_forward_ops": (),
        "stage": _stage_of(layout),
    }
    del layout, net
    if config["check_gradients"]:
        error, worst = layout_gradient_error(mf, plan, parallel, device, seed, rank)
        out["gradient_error"] = layout_gradient_check(error, plan, parallel, worst)
    return out


def layout_gradient_check(
    error: float | str, plan: Plan, parallel: Parallel, worst: str | None = None
) -> dict[str, Any]:
    """``error`` (from :func:`layout_gradient_error`, with the parameter of that largest
    difference, ``worst``) as the JSON-ready plan check the distributed verify reads from
    every rank (memplan.verify.distributed_grads): no batch coupling is measured for a
    layout."""
    from memplan.verify.grad_check import TOLERANCE, GradientCheck, coupling_skipped, layer_of

    tol = TOLERANCE["fp32"]
    what = (
        f"{parallel.describe()}: each rank's gradient (its shard) vs one process's gradient "
        f"of the whole {plan.micro_batch_size * plan.accumulation_steps * parallel.dp} "
        "samples (dropout off)"
    )
    if isinstance(error, str):
        check = GradientCheck(status="fail", relative_error=None, tolerance=tol, reason=error)
    else:
        status = "pass" if error <= tol else "fail"  # NaN fails
        value = error if math.isfinite(error) else None
        fingerprint = plan.model_fingerprint
        layers = list(fingerprint.candidate_layers) if fingerprint else list(plan.checkpoint)
        check = GradientCheck(
            status=status,
            relative_error=value,
            tolerance=tol,
            reason=what,
            precision="fp32",
            worst_parameter=worst,
            worst_parameter_error=value if worst is not None else None,
            worst_layer=layer_of(worst, layers) if worst is not None else None,
        )
    effective = plan.micro_batch_size * plan.accumulation_steps * parallel.dp
    skipped = coupling_skipped(effective, "not measured for a parallel layout")
    return {"check": dataclasses.asdict(check), "coupling": dataclasses.asdict(skipped)}


def _stage_of(layout: Any) -> str:
    if not layout.stage_ranges:
        return ""
    layers = layout.stage_ranges[0]
    return f"stage layers {layers.start}-{layers.stop - 1}"


def _local_slice(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return full[index]


def layout_gradient_error(
    mf: Any, plan: Plan, parallel: Parallel, device: torch.device, seed: int, rank: int
) -> tuple[float | str, str | None]:
    """max over this rank's parameters of max|g_rank − g_full| / max|g_full| (see the
    module doc), and the parameter where it is largest (None when not compared)."""
    from memplan import run
    from memplan.model.batch import map_batch
    from memplan.run.parallel import build_layout, data_rank

    k, micro, dp = plan.accumulation_steps, plan.micro_batch_size, parallel.dp
    torch.manual_seed(seed)
    reference_net = mf.build_model().to(device).train()
    torch.manual_seed(seed + 10_000)
    full = map_batch(mf.make_batch(dp * k * micro), lambda t: t.to(device))
    with run.no_dropout(), users_backward(mf):  # the backward's errors: the file's
        mf.loss(reference_net, full).backward()
    reference = {
        name: p.grad.detach().float().clone()
        for name, p in reference_net.named_parameters()
        if p.grad is not None
    }
    del reference_net
    torch.manual_seed(seed)
    net = mf.build_model().to(device).train()
    run.apply(net, plan)
    layout = build_layout(
        net,
        plan,
        parallel,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.0),
        device,
        declared_tp_plan=getattr(mf.module, "TP_PLAN", None),
    )
    first = data_rank(parallel, rank) * k
    # the tensors holding the samples first cut, the others whole (plan_check.micro_rows)
    rows = micro_rows(mf, plan, full, samples=dp * k * micro)
    mine = [cut_batch(full, rows, i * micro, (i + 1) * micro) for i in range(first, first + k)]
    captured: dict[str, torch.Tensor] = {}
    shards = dict(layout.dtensor_placements)

    # The optimizer's parameters by name, read now: DDP's TP composition
    # (torch.distributed.tensor.parallel.ddp) swaps DTensor parameters for plain attributes
    # in each forward, after which net.named_parameters() no longer lists them.
    names = {id(p): name for name, p in net.named_parameters()}

    def capture(*_: Any) -> None:  # before the optimizer step (lr 0), whoever calls it
        from torch.distributed.tensor import DTensor

        params = [p for group in layout.optimizer.param_groups for p in group["params"]]
        for p in params:
            name = names.get(id(p))
            grad = p.grad
            if name is None or grad is None:
                continue
            if isinstance(grad, DTensor):  # compare this rank's shard: no collective
                shards[name] = (grad.device_mesh, tuple(grad.placements))
                grad = grad.to_local()
            captured[name] = grad.detach().float()

    layout.optimizer.register_step_pre_hook(capture)
    with run.no_dropout(), users_backward(mf):
        layout.train_step(mine, mf.loss)
    worst, worst_name = 0.0, None
    for name, got in captured.items():
        ref = reference.get(name)
        if ref is None:
            return f"{name} has a gradient under the layout but none in the reference", name
        if name in shards:
            ref = _local_slice(ref, *shards[name])
        if got.shape != ref.shape:
            shapes = f"gradient of shape {tuple(got.shape)}, reference {tuple(ref.shape)}"
            return f"{name}: {shapes}", name
        if not (bool(torch.isfinite(ref).all()) and bool(torch.isfinite(got).all())):
            return math.nan, name
        scale = ref.abs().max().item()
        if scale > 0:
            error = (got - ref).abs().max().item() / scale
            if worst_name is None or error > worst:
                worst, worst_name = error, name
    if not captured:
        return "this rank holds no parameters with gradients", None
    return worst, worst_name
