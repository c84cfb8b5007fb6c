"""The distributed gradient check of ``memplan verify --world-size N``: N ranks × k
micro-batches must give the gradient of one batch of N × k × micro samples (the
data-parallel form of the accumulation rule), compared per parameter. Run inside each rank
by memplan.distributed."""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.plan import Plan
from memplan.run.wrap import COMPUTE_DTYPES, fsdp_mixed_precision, wrap_for_plan
from memplan.verify.single import GRAD_TOLERANCE, GradientCheck


def _mixed_precision_reference(
    net: torch.nn.Module, mf: Any, plan: Plan, full: Any, world: int, map_batch: Any
) -> dict[str, torch.Tensor]:
    """The reference gradient under FSDP's mixed-precision policy, in one process: each of
    the world × k micro-batches' loss / k back-propagated with bf16 parameters and inputs,
    each gradient upcast to fp32 and the sum divided by the world size, as the ranks' fp32
    reduction does. (An fp32 reference would differ by bf16's own rounding through every op,
    several percent: that would test bf16, not the data-parallel accumulation.)"""
    from memplan.probe.backends import cast_parameters

    dtype = COMPUTE_DTYPES[plan.precision]
    k, micro = plan.accumulation_steps, plan.micro_batch_size
    cast_parameters(net, dtype)
    total: dict[str, torch.Tensor] = {}
    for i in range(world * k):
        piece = map_batch(full, lambda t, i=i: t[i * micro : (i + 1) * micro])
        piece = map_batch(piece, lambda t: t.to(dtype) if t.is_floating_point() else t)
        net.zero_grad(set_to_none=True)
        (mf.loss(net, piece) / k).backward()
        for name, p in net.named_parameters():
            if p.grad is not None:
                grad = p.grad.detach().float()
                total[name] = total[name] + grad if name in total else grad.clone()
    return {name: grad / world for name, grad in total.items()}


def _full_grad(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach().float()


def gradient_error(
    mf: Any, plan: Plan, device: torch.device, seed: int, rank: int, world: int, map_batch: Any
) -> float | str | None:
    """max over parameters of max|g_ranks − g_full| / max|g_full|, where g_ranks is the
    gradient after this rank's k micro-batches (synchronised by the strategy) and g_full one
    process's gradient of the whole N × k × micro batch. A string says why it was skipped."""
    from memplan import run

    k, micro = plan.accumulation_steps, plan.micro_batch_size
    torch.manual_seed(seed)
    reference_net = mf.build_model().to(device).train()
    kinds = (torch.nn.modules.batchnorm._BatchNorm,)
    if any(isinstance(m, kinds) for m in reference_net.modules()):
        return "the model has BatchNorm: statistics are per micro-batch and per rank"
    torch.manual_seed(seed + 10_000)  # the same full batch on every rank
    full = map_batch(mf.make_batch(world * k * micro), lambda t: t.to(device))
    policy = fsdp_mixed_precision(plan)
    # Dropout masks depend on the batch shape: both sides run with every dropout neutralised
    # (modules, functional, fused attention dropout), in train mode so checkpointing still
    # runs; the same aten-level mode as single-process verify (run.no_dropout).
    with run.no_dropout():
        if policy is None:
            mf.loss(reference_net, full).backward()
            reference = {
                name: p.grad.detach().float().clone()
                for name, p in reference_net.named_parameters()
                if p.grad is not None
            }
        else:
            reference = _mixed_precision_reference(reference_net, mf, plan, full, world, map_batch)
    del reference_net

    torch.manual_seed(seed)
    net = mf.build_model().to(device).train()
    run.apply(net, plan)
    # lr 0: the optimizer step must not move the weights before the gradients are read
    model, optimizer = wrap_for_plan(
        net, plan, lambda m: torch.optim.SGD(m.parameters(), lr=0.0), device
    )
    acc = run.Accumulator(model, optimizer, plan, device=device)
    pieces = [
        map_batch(full, lambda t, i=i: t[i * micro : (i + 1) * micro]) for i in range(world * k)
    ]
    mine = pieces[rank * k : (rank + 1) * k]
    captured: dict[str, torch.Tensor] = {}
    original_step = optimizer.step

    def step_and_capture(*args: Any, **kwargs: Any) -> Any:
        for name, p in net.named_parameters():
            if p.grad is not None:
                captured[name] = _full_grad(p.grad)
        return original_step(*args, **kwargs)

    optimizer.step = step_and_capture  # type: ignore[method-assign]
    with run.no_dropout():
        for piece in mine:
            acc.step(piece, mf.loss)
    worst = 0.0
    for name, ref in reference.items():
        got = captured.get(name)
        if got is None:
            return math.inf
        if not (bool(torch.isfinite(ref).all()) and bool(torch.isfinite(got).all())):
            return math.nan  # max() would drop it: the driver fails the check on it
        scale = ref.abs().max().item()
        if scale > 0:
            worst = max(worst, (got - ref).abs().max().item() / scale)
    return worst


def gradient_check(plan: Plan, errors: list[Any], asked: bool, world: int) -> GradientCheck:
    tol = GRAD_TOLERANCE[plan.precision]
    if not asked:
        return GradientCheck(
            status="skipped", max_relative_error=None, tolerance=tol, reason="not asked for"
        )
    reasons = [e for e in errors if isinstance(e, str)]
    if reasons:
        return GradientCheck(
            status="skipped", max_relative_error=None, tolerance=tol, reason=reasons[0]
        )
    k, micro = plan.accumulation_steps, plan.micro_batch_size
    if not all(math.isfinite(float(e)) for e in errors):
        return GradientCheck(
            status="fail",
            max_relative_error=None,
            tolerance=tol,
            reason="NaN or inf in a gradient (accumulated or full-batch) on rank "
            f"{next(r for r, e in enumerate(errors) if not math.isfinite(float(e)))}",
        )
    worst = max(float(e) for e in errors)
    return GradientCheck(
        status="pass" if worst <= tol else "fail",
        max_relative_error=worst,
        tolerance=tol,
        reason=f"{world} ranks × {k} micro-batches of {micro} ({plan.strategy}) vs one "
        f"process's batch of {world * k * micro} (dropout off"
        + (
            f"; {plan.precision} parameters, each micro-batch's gradient summed in fp32)"
            if plan.mixed_precision == "params"
            else ")"
        ),
    )
