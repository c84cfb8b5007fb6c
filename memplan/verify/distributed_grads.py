"""The distributed gradient check of ``memplan verify --world-size N``, the same two
questions as one process (memplan.verify.grad_check): the plan check — N ranks × k
micro-batches under the plan's strategy must give the textbook gradient of those N × k
micro-batches — and the batch coupling (those micro-batches against one batch of
N × k × micro). Run inside each rank by memplan.verify.distributed."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from memplan.model.batch import cut_batch
from memplan.plan import Plan
from memplan.probe.session import users_backward
from memplan.run.float8 import convert_for_plan
from memplan.run.wrap import COMPUTE_DTYPES, fsdp_mixed_precision, wrap_for_plan
from memplan.verify.grad_check import (
    TOLERANCE,
    BatchCoupling,
    GradientCheck,
    StepCapture,
    coupling,
    coupling_skipped,
    judge,
    layer_set_failure,
    step_count_failure,
    textbook,
)
from memplan.verify.plan_check import micro_rows, plan_autocast


def _mixed_precision_reference(
    net: torch.nn.Module, mf: Any, plan: Plan, pieces: list[Any], world: int, map_batch: Any
) -> dict[str, torch.Tensor]:
    """The reference gradient under FSDP's mixed-precision policy, in one process: each of
    the world × k micro-batches' loss / k back-propagated with bf16 parameters and inputs,
    each gradient upcast to fp32 and the sum divided by the world size, as the ranks' fp32
    reduction does. (An fp32 reference would differ by bf16's own rounding through every op,
    several percent: that would test bf16, not the data-parallel accumulation.)"""
    from memplan.probe.backends import cast_parameters

    dtype = COMPUTE_DTYPES[plan.precision]
    k = plan.accumulation_steps
    cast_parameters(net, dtype)
    total: dict[str, torch.Tensor] = {}
    for i in range(world * k):
        piece = map_batch(pieces[i], lambda t: t.to(dtype) if t.is_floating_point() else t)
        net.zero_grad(set_to_none=True)
        (mf.loss(net, piece) / k).backward()
        for name, p in net.named_parameters():
            if p.grad is not None:
                grad = p.grad.detach().float()
                total[name] = total[name] + grad if name in total else grad.clone()
    return {name: grad / world for name, grad in total.items()}


def check_precision(plan: Plan) -> str:
    """The precision the ranks' check compares in, as one process's does: the plan's under
    autocast or FSDP's mixed-precision policy (bf16/fp16), else fp32. (Before, an autocast
    plan's ranks were judged at fp32's 1e-4 against an fp32 reference: a false FAIL.)"""
    return plan.precision if plan.precision in ("bf16", "fp16") else "fp32"


def gradient_error(
    mf: Any, plan: Plan, device: torch.device, seed: int, rank: int, world: int, map_batch: Any
) -> dict[str, Any]:
    """This rank's plan check (memplan.verify.grad_check): its gradients after its k
    micro-batches, synchronised by the strategy, against the textbook gradient of all
    N × k micro-batches in one process (each loss / k, summed, divided by N as the ranks
    average). Rank 0 also measures the batch coupling. JSON-ready dicts of both."""
    from memplan import run

    k, micro = plan.accumulation_steps, plan.micro_batch_size
    torch.manual_seed(seed + 10_000)  # the same batches on every rank
    full = map_batch(mf.make_batch(world * k * micro), lambda t: t.to(device))
    # each tensor holding the samples first cut, the others (a 0-dim temperature, a shared
    # mask) whole in every piece, as one process's check cuts them (plan_check.micro_rows);
    # before, every tensor was sliced, and a 0-dim one raised IndexError on every rank
    rows = micro_rows(mf, plan, full, samples=world * k * micro)
    pieces = [cut_batch(full, rows, i * micro, (i + 1) * micro) for i in range(world * k)]
    seeds = [seed + 1 + i for i in range(world * k)]
    policy = fsdp_mixed_precision(plan)
    autocast = plan_autocast(plan, device)  # the ranks' Accumulator runs under it
    precision = check_precision(plan)
    tol = TOLERANCE[precision]
    fingerprint = plan.model_fingerprint
    layers = list(fingerprint.candidate_layers) if fingerprint else list(plan.checkpoint)
    torch.manual_seed(seed)
    reference_net = mf.build_model().to(device).train()
    convert_for_plan(reference_net, plan, device, reference=True)  # float8: both sides alike
    run.disable_kv_cache(reference_net)
    # Dropout masks would depend on how the ranks' wrappers draw random numbers: both sides
    # run with every dropout neutralised (modules, functional, fused attention dropout), in
    # train mode so checkpointing still runs (run.no_dropout).
    couple: dict[str, Any] | None = None
    with run.no_dropout(), users_backward(mf):  # the backward's errors: the file's
        if policy is None:
            reference = textbook(reference_net, mf.loss, pieces, seeds, k=k, autocast=autocast)
            if rank == 0 and world * k > 1:
                batch = textbook(reference_net, mf.loss, [full], seeds[:1], k=1, autocast=autocast)
                couple = dataclasses.asdict(
                    coupling(
                        reference,
                        batch,
                        model=reference_net,
                        tolerance=tol,
                        effective_batch=world * k * micro,
                        k=world * k,
                        micro_size=micro,
                    )
                )
        else:
            reference = _mixed_precision_reference(
                reference_net, mf, plan, pieces, world, map_batch
            )
    del reference_net

    torch.manual_seed(seed)
    net = mf.build_model().to(device).train()
    convert_for_plan(net, plan, device)
    run.apply(net, plan)
    wrong = layer_set_failure(run.checkpointed_modes(net), run.layer_modes(plan), tol, precision)
    if wrong is not None:
        return {"check": dataclasses.asdict(wrong), "coupling": couple}
    # lr 0: the optimizer step must not move the weights before the gradients are read
    model, optimizer = wrap_for_plan(
        net, plan, lambda m: torch.optim.SGD(m.parameters(), lr=0.0), device
    )
    capture = StepCapture(optimizer, net)
    acc = run.Accumulator(model, optimizer, plan, device=device)
    with run.no_dropout(), users_backward(mf):  # the backward's errors: the file's
        for i in range(rank * k, (rank + 1) * k):
            torch.manual_seed(seeds[i])
            acc.step(pieces[i], mf.loss)
    what = (
        f"{world} ranks × {k} micro-batch(es) of {micro} ({plan.strategy}) vs the same "
        f"{world * k} micro-batches without checkpointing in one process, loss / {k} "
        "accumulated and averaged over the ranks (dropout off"
        + (
            f"; {plan.precision} parameters, each micro-batch's gradient summed in fp32)"
            if policy is not None
            else f"; both under {plan.precision} autocast)"
            if autocast is not None
            else ")"
        )
    )
    check = step_count_failure(capture.calls, k, tol, precision) or judge(
        {n: g.float() for n, g in capture.grads.items()},
        reference,
        tolerance=tol,
        layers=layers,
        what=what,
        precision=precision,
    )
    return {"check": dataclasses.asdict(check), "coupling": couple}


def gradient_check(
    plan: Plan, results: list[Any], asked: bool, world: int
) -> tuple[GradientCheck, BatchCoupling]:
    """The ranks' plan checks as one (the worst rank's, named) and rank 0's coupling."""
    tol = TOLERANCE[check_precision(plan)]
    effective = world * plan.accumulation_steps * plan.micro_batch_size
    if not asked or any(r is None for r in results):
        reason = "not asked for (--no-grad-check)"
        return (
            GradientCheck(status="skipped", relative_error=None, tolerance=tol, reason=reason),
            coupling_skipped(effective, reason),
        )
    checks = [GradientCheck(**r["check"]) for r in results]

    def badness(check: GradientCheck) -> tuple[bool, float]:
        error = check.relative_error
        return (check.status == "fail", math.inf if error is None else error)

    worst_rank = max(range(len(checks)), key=lambda r: badness(checks[r]))
    worst = checks[worst_rank]
    if worst.status == "fail":
        worst = dataclasses.replace(worst, reason=f"rank {worst_rank}: {worst.reason}")
    couple_data = results[0].get("coupling")
    couple = (
        BatchCoupling(**couple_data)
        if couple_data
        else coupling_skipped(effective, "not measured under a mixed-precision policy")
    )
    return worst, couple
