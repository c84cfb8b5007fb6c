"""The one-process gradient check of verify (memplan.verify.grad_check says what it asks):
the plan's run of k micro-batches against the same micro-batches run the textbook way, and
separately, the k micro-batches against one batch of the effective size. When the plan check
fails on a plan that checkpoints, each checkpointed layer is tried alone to name the one
whose recompute differs from its forward."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import torch

from memplan import run
from memplan.errors import ModelFileError, first_line
from memplan.model.batch import cut_batch, map_batch, sample_rows
from memplan.model.loader import ModelFile
from memplan.plan import Plan
from memplan.verify.grad_check import (
    TOLERANCE,
    BatchCoupling,
    GradientCheck,
    StepCapture,
    coupling,
    coupling_cause,
    coupling_skipped,
    default_dtype,
    judge,
    layer_set_failure,
    relative_error,
    seed_all,
    step_count_failure,
    textbook,
    to_dtype,
)

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
MAX_LAYERS_TRIED = 24
"""When the plan check fails, at most this many checkpointed layers are tried one by one."""


def plan_autocast(plan: Plan, device: torch.device) -> Any:
    """The autocast the plan's run uses (as ``Accumulator`` sets it up), or None."""
    dtype = _AUTOCAST.get(plan.precision)
    if dtype is None or plan.mixed_precision == "params":
        return None
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def check_gradients(
    mf: ModelFile, plan: Plan, device: torch.device, seed: int
) -> tuple[GradientCheck, BatchCoupling]:
    """The plan check and the batch coupling of ``plan`` (see memplan.verify.grad_check):
    in float64 for an fp32 plan, unless the model does not run in it."""
    k, micro = plan.accumulation_steps, plan.micro_batch_size
    torch.manual_seed(seed + 10_000)
    full = mf.make_batch(k * micro)
    rows = micro_rows(mf, plan, full)
    if plan.precision == "fp32":
        try:
            return _check(mf, plan, device, seed, full, rows, torch.float64)
        except Exception as exc:  # the model does not run (or fit) in float64: use fp32
            # (a model file that fails for another reason fails again, in fp32, and is
            # reported as such)
            note = (
                f" (compared in fp32: in float64 the model failed with {type(exc).__name__}: "
                f"{first_line(exc)[:200]})"
            )
        grad, couple = _fits(mf, plan, device, seed, full, rows)
        return _with_reason(grad, grad.reason + note), couple
    return _fits(mf, plan, device, seed, full, rows)


def micro_rows(
    mf: ModelFile, plan: Plan, full: Any | None = None, samples: int | None = None
) -> list[bool] | None:
    """Which tensors of a batch of the plan's effective size ``full`` (made when None) the
    check cuts into its micro-batches along their first dimension, from the shapes of a
    micro-batch's (``memplan.model.batch.sample_rows``): a tensor the same at both sizes
    (a 0-dim temperature, a shared mask) goes whole into each. None: one micro-batch a
    step, nothing to cut. A tensor that changes with the batch size other than along its
    first dimension is the model file's error (exit 2, naming it), raised before any run."""
    k, micro = plan.accumulation_steps, plan.micro_batch_size
    count = k * micro if samples is None else samples  # (the ranks': world × k × micro)
    if count == micro:
        return None
    full = mf.make_batch(count) if full is None else full
    try:
        return sample_rows(full, mf.make_batch(micro), count, micro)
    except ValueError as exc:
        fn = mf.batch_text or f"{mf.named('make_batch')}()"
        raise ModelFileError(
            f"{mf.path}: {fn}: {exc}. verify's gradient check cuts a batch of {count} "
            f"samples into {count // micro} micro-batches of {micro} along each tensor's first dimension "
            "(a tensor of the same shape at every size is passed whole).",
            hint="Put the samples first in each tensor that grows with the batch size, or "
            "verify without the gradient check (--no-grad-check).",
        ) from exc


def _fits(
    mf: ModelFile, plan: Plan, device: torch.device, seed: int, full: Any, rows: Any
) -> tuple[GradientCheck, BatchCoupling]:
    """The check in the plan's own precision; skipped when its second copy of the model
    does not fit the device."""
    try:
        return _check(mf, plan, device, seed, full, rows, None)
    except torch.OutOfMemoryError:
        reason = "the textbook run's copy of the model does not fit this device next to the plan's"
        effective = plan.accumulation_steps * plan.micro_batch_size
        return (
            GradientCheck(
                status="skipped",
                relative_error=None,
                tolerance=TOLERANCE[plan.precision],
                reason=reason,
            ),
            coupling_skipped(effective, reason),
        )


def _with_reason(check: GradientCheck, reason: str) -> GradientCheck:
    return dataclasses.replace(check, reason=reason)


def _check(
    mf: ModelFile,
    plan: Plan,
    device: torch.device,
    seed: int,
    full: Any,
    rows: list[bool] | None,
    dtype: torch.dtype | None,
) -> tuple[GradientCheck, BatchCoupling]:
    k, micro = plan.accumulation_steps, plan.micro_batch_size
    precision = "fp64" if dtype is not None else plan.precision
    tol = TOLERANCE[precision]
    full = run.move_to_device(to_dtype(full, dtype, map_batch), device)
    pieces = [cut_batch(full, rows, i * micro, (i + 1) * micro) for i in range(k)]
    seeds = [seed + 1 + i for i in range(k)]
    autocast = plan_autocast(plan, device)
    fingerprint = plan.model_fingerprint
    layers = list(fingerprint.candidate_layers) if fingerprint else list(plan.checkpoint)
    build = functools.partial(_build, mf, device, seed, dtype)
    with default_dtype(dtype) if dtype is not None else contextlib.nullcontext():
        reference = textbook(build(), mf.loss, pieces, seeds, k=k, autocast=autocast)
        got, failure = _plan_run(build(), mf, plan, pieces, seeds, device, tol, precision)
        what = (
            f"the plan's {k} micro-batch(es) of {micro} vs the same run without checkpointing, "
            f"loss / {k} accumulated, one step ({precision})"
        )
        check = failure or judge(
            got, reference, tolerance=tol, layers=layers, what=what, precision=precision
        )
        if check.status == "fail" and failure is None and plan.checkpoint_layers:
            check = _localise(check, build, mf, plan, pieces, seeds, autocast)
        couple = _coupling(build, mf, plan, pieces, seeds, full, autocast, tol)
    return check, couple


def _build(mf: ModelFile, device: torch.device, seed: int, dtype: torch.dtype | None) -> Any:
    seed_all(seed)
    net = mf.build_model().to(device)
    if dtype is not None:
        net = net.to(dtype)
    net.train()
    run.disable_kv_cache(net)  # as the plan's run does (run.apply)
    return net


def _plan_run(
    net: torch.nn.Module,
    mf: ModelFile,
    plan: Plan,
    pieces: list[Any],
    seeds: list[int],
    device: torch.device,
    tol: float,
    precision: str,
) -> tuple[dict[str, torch.Tensor], GradientCheck | None]:
    """The plan's run: ``memplan.apply`` and the ``Accumulator``, each micro-batch after the
    textbook run's seed; the gradients at the optimizer step, or why the run is wrong before
    any gradient is compared."""
    run.apply(net, plan)
    wrong = layer_set_failure(run.checkpointed_modes(net), run.layer_modes(plan), tol, precision)
    if wrong is not None:
        return {}, wrong
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)  # must not move weights
    capture = StepCapture(optimizer, net)
    acc = run.Accumulator(net, optimizer, plan, device=device)
    for piece, seed in zip(pieces, seeds, strict=True):
        seed_all(seed)
        acc.step(piece, mf.loss)
    return capture.grads, step_count_failure(capture.calls, len(pieces), tol, precision)


def _localise(
    check: GradientCheck,
    build: Any,
    mf: ModelFile,
    plan: Plan,
    pieces: list[Any],
    seeds: list[int],
    autocast: Any,
) -> GradientCheck:
    """Checkpoint each of the plan's layers alone, textbook accumulation otherwise; name
    those whose run differs from the plain one (their recompute is not their forward)."""
    k = len(pieces)
    reference = textbook(build(), mf.loss, pieces, seeds, k=k, autocast=autocast)
    again = textbook(build(), mf.loss, pieces, seeds, k=k, autocast=autocast)
    unrepeatable = judge(
        again, reference, tolerance=check.tolerance, layers=[], what="", precision=""
    )
    if unrepeatable.status == "fail":  # no layer's fault: the model is not repeatable
        return dataclasses.replace(
            check,
            status="skipped",
            worst_layer=None,
            reason="not judged: two runs of the same micro-batches without checkpointing, "
            "each after the same seeds (torch, numpy, Python random), differ by "
            f"{unrepeatable.relative_error:.2e} themselves: the model draws randomness from "
            "a source memplan does not seed, or keeps state between runs, outside the "
            "checkpointed layers (no layer is at fault)",
        )
    modes = list(run.layer_modes(plan).items())
    differ = []
    for name, mode in modes[:MAX_LAYERS_TRIED]:
        net = build()
        run.apply(net, {name: mode})
        got = textbook(net, mf.loss, pieces, seeds, k=k, autocast=autocast)
        alone = judge(
            got, reference, tolerance=check.tolerance, layers=[name], what="", precision=""
        )
        if alone.status == "fail":
            differ.append(name)
    if differ:
        tried = "" if len(modes) <= MAX_LAYERS_TRIED else f" (first {MAX_LAYERS_TRIED} tried)"
        return dataclasses.replace(
            check,
            worst_layer=differ[0],
            diagnosis=f"checkpointing layer {differ[0]} alone changes the gradients"
            + (f" (and so does each of {len(differ) - 1} more)" if len(differ) > 1 else "")
            + ": its recompute differs from its forward, it is not checkpoint-safe (its forward reads state "
            "that changes between calls, or draws random numbers outside torch's RNG)" + tried,
        )
    return dataclasses.replace(
        check,
        diagnosis="every checkpointed layer recomputes as it ran forward, so "
        "the difference is in the accumulation or the step",
    )


def _coupling(
    build: Any,
    mf: ModelFile,
    plan: Plan,
    pieces: list[Any],
    seeds: list[int],
    full: Any,
    autocast: Any,
    tol: float,
) -> BatchCoupling:
    """k micro-batches the textbook way against one batch of k × micro, dropout off."""
    k, micro = plan.accumulation_steps, plan.micro_batch_size
    effective = k * micro
    if k == 1:
        return coupling_skipped(effective, "one micro-batch per step: nothing to compare")
    try:
        with run.no_dropout():
            net = build()
            micro_grads = textbook(net, mf.loss, pieces, seeds, k=k, autocast=autocast)
            net = build()  # afresh: a model may keep state across calls
            batch_grads = textbook(net, mf.loss, [full], seeds[:1], k=1, autocast=autocast)
            result = coupling(
                micro_grads,
                batch_grads,
                model=net,
                tolerance=tol,
                effective_batch=effective,
                k=k,
                micro_size=micro,
            )
            if result.status != "differs":
                return result
            # Evidence before a cause: randomness beyond dropout (other seeds, other
            # gradients: SpecAugment's masks, a drop-path memplan does not recognise) makes
            # the comparison meaningless; else is the loss itself coupled?
            other = [seed + 1_000 for seed in seeds]
            reseeded = textbook(build(), mf.loss, pieces, other, k=k, autocast=autocast)
            random = relative_error(reseeded, micro_grads)
            if not (math.isfinite(random) and random <= tol):
                return coupling_skipped(
                    effective,
                    "not measured: with dropout off the model's gradients still depend on the "
                    f"random seed (by {random:.1e}): its training forward draws random numbers "
                    "beyond dropout (e.g. SpecAugment masking, or a stochastic depth memplan "
                    "does not recognise), so micro-batches and one batch draw differently",
                )
            couples = _loss_couples(build(), mf, pieces, full, autocast, tol)
            return dataclasses.replace(result, cause=coupling_cause(net, couples))
    except torch.OutOfMemoryError:
        return coupling_skipped(effective, f"one batch of {effective} does not fit this device")


def _loss_couples(
    net: torch.nn.Module, mf: ModelFile, pieces: list[Any], full: Any, autocast: Any, tol: float
) -> bool:
    """In eval mode and without gradients, is one batch's loss other than the mean of its
    micro-batches' losses (an in-batch loss term)? BatchNorm uses its running statistics
    there, so only the loss itself can couple the samples."""
    net.eval()
    with torch.no_grad(), autocast() if autocast is not None else contextlib.nullcontext():
        parts = torch.stack([mf.loss(net, piece).detach().double() for piece in pieces])
        whole = mf.loss(net, full).detach().double()
    diff = float((parts.mean() - whole).abs())
    return not diff <= tol * max(float(whole.abs()), 1e-12)
