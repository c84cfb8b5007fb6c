"""verify's gradient check, as two questions kept apart.

**The plan check** asks: does the plan — its checkpointing, its accumulation, its strategy —
change the math? The plan's run of k micro-batches (``memplan.apply`` + ``Accumulator``) is
compared with the *same* micro-batches run the textbook way: no checkpointing, each
micro-batch's ``loss / k`` back-propagated into the same gradients, one optimizer step. Both
sides start from the same weights, and each micro-batch runs after the same RNG seed, so
dropout draws the same masks unless a recompute forgets the RNG state. Both run in float64
where the model runs in it (rounding then sits near 1e-15, so a real bug stands out by ten
orders of magnitude). Judged by

    relative_error = ‖g_plan − g_ref‖ / ‖g_ref‖                      (over all parameters)
    parameter p:     ‖g_plan,p − g_ref,p‖ / max(‖g_ref,p‖, FLOOR × ‖g_ref‖)

both at most the tolerance. The floor keeps a parameter whose true gradient is zero (a
key bias under softmax) from failing on rounding noise over rounding noise; above it a
small parameter is still judged against itself. The optimizer must step exactly once.

**Batch coupling** asks: does micro-batching itself change the objective? The textbook
gradient of the k micro-batches is compared with one batch of all k × micro samples, with
dropout off (its masks depend on the batch shape). BatchNorm, an MoE's load-balancing loss
or a contrastive loss couple the samples of a batch, so the two legitimately differ; that is
a property of the loss, reported as a warning, never a failure of the plan.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

FLOOR = 1e-3
"""A parameter's gradient difference is measured against at least this share of the global
gradient norm."""

TOLERANCE = {"fp64": 1e-6, "fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}
"""Largest relative difference that passes, by the precision both sides ran in. The two
sides run the same ops on the same numbers: float64 agrees to ~1e-15, fp32 to ~1e-7;
autocast recomputes in bf16/fp16 (~1e-2)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GradientCheck:
    """The plan check: the plan's gradients against the textbook run's."""

    status: Literal["pass", "fail", "skipped"]
    relative_error: float | None
    """‖g_plan − g_ref‖ / ‖g_ref‖ over all parameters; None when not compared."""
    tolerance: float
    reason: str
    worst_parameter: str | None = None
    """The parameter of largest relative difference (against its floor)."""
    worst_parameter_error: float | None = None
    worst_layer: str | None = None
    """The plan's layer (or else module) holding ``worst_parameter``."""
    precision: str = ""
    """What both sides ran in: fp64, fp32, bf16 or fp16."""
    diagnosis: str = ""
    """On failure, where the difference comes from (the layer whose recompute differs)."""

    @property
    def failure_text(self) -> str:
        """One line saying how it failed (see :func:`gradient_failure`)."""
        return gradient_failure(self)


def gradient_failure(check: GradientCheck) -> str:
    """One line saying how the plan check failed, naming the worst parameter and layer."""
    if check.relative_error is None:
        text = check.reason
    else:
        text = (
            f"the plan's gradients differ from the textbook run's by "
            f"{check.relative_error:.2e} (tolerance {check.tolerance:.0e})"
        )
        if check.worst_parameter is not None and check.worst_parameter_error is not None:
            text += (
                f"; worst parameter {check.worst_parameter} in layer {check.worst_layer} "
                f"({check.worst_parameter_error:.2e})"
            )
    return f"{text}; {check.diagnosis}" if check.diagnosis else text


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchCoupling:
    """Whether k micro-batches optimise the same objective as one batch of k × micro."""

    status: Literal["equivalent", "differs", "skipped"]
    relative_error: float | None
    """‖g_micro − g_batch‖ / ‖g_batch‖; None when not compared."""
    effective_batch: int
    cause: str = ""
    """The likely cause when it differs (BatchNorm, an MoE auxiliary loss, an in-batch loss)."""
    reason: str = ""


# ---------------------------------------------------------------------------- judging
def layer_of(parameter: str, layers: Sequence[str]) -> str:
    """The longest of ``layers`` that holds ``parameter``, else its module's name."""
    holders = [name for name in layers if parameter.startswith(name + ".")]
    if holders:
        return max(holders, key=len)
    return parameter.rpartition(".")[0] or parameter


def relative_error(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> float:
    """‖got − ref‖ / ‖ref‖ over the parameters of ``ref`` (a missing one counts as zero)."""
    diff_sq = ref_sq = 0.0
    for name, expected in ref.items():
        expected = expected.double()
        actual = got.get(name)
        actual = torch.zeros_like(expected) if actual is None else actual.double()
        diff_sq += float(((actual - expected) ** 2).sum())
        ref_sq += float((expected**2).sum())
    return _ratio(math.sqrt(diff_sq), math.sqrt(ref_sq))


def _ratio(diff: float, scale: float) -> float:
    if not math.isfinite(diff) or not math.isfinite(scale):
        return math.nan
    if scale > 0:
        return diff / scale
    return 0.0 if diff == 0 else math.inf


def judge(
    got: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    *,
    tolerance: float,
    layers: Sequence[str],
    what: str,
    precision: str,
) -> GradientCheck:
    """The plan check's verdict on two gradient sets (see the module doc)."""
    common = {"tolerance": tolerance, "precision": precision}
    for name, grads in (("textbook", ref), ("plan", got)):
        bad = next((n for n, g in grads.items() if not bool(torch.isfinite(g).all())), None)
        if bad is not None:
            return GradientCheck(
                status="fail",
                relative_error=None,
                reason=f"parameter {bad} has NaN or inf in its gradient in the {name} run",
                worst_parameter=bad,
                worst_layer=layer_of(bad, layers),
                **common,
            )
    missing = next((n for n in ref if n not in got), None)
    if missing is not None:
        return GradientCheck(
            status="fail",
            relative_error=None,
            reason=f"parameter {missing} got no gradient under the plan",
            worst_parameter=missing,
            worst_layer=layer_of(missing, layers),
            **common,
        )
    error = relative_error(got, ref)
    floor = FLOOR * math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref.values()))
    worst, worst_error = None, 0.0
    for name, expected in ref.items():
        diff = float((got[name].double() - expected.double()).norm())
        scale = max(float(expected.double().norm()), floor)
        param_error = _ratio(diff, scale)
        if worst is None or param_error > worst_error:
            worst, worst_error = name, param_error
    passed = error <= tolerance and worst_error <= tolerance
    return GradientCheck(
        status="pass" if passed else "fail",
        relative_error=error,
        reason=what,
        worst_parameter=worst,
        worst_parameter_error=worst_error,
        worst_layer=layer_of(worst, layers) if worst else None,
        **common,
    )


# ---------------------------------------------------------------------------- coupling
UNKNOWN_CAUSE = (
    "unknown (no BatchNorm, no router loss, and the loss alone does not couple the samples)"
)


def coupling_cause(model: torch.nn.Module, loss_couples: bool | None = None) -> str:
    """Why a model's micro-batches differ from one batch, from evidence only: a BatchNorm
    in training mode (statistics per micro-batch), a router's auxiliary loss switched on
    (``output_router_logits``), or ``loss_couples`` (measured: in eval mode without
    dropout, one batch's loss is not the mean of its micro-batches' losses, an in-batch
    term such as a contrastive loss); else unknown. A parameter's or a class's name is no
    evidence (a Swin-v2 ``logit_scale`` scales its attention, not a CLIP loss)."""
    if any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()
    ):
        return "BatchNorm: its statistics are computed per micro-batch"
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) is True:
        return (
            "an MoE auxiliary (load-balancing) loss: it is computed over the micro-batch's tokens"
        )
    if loss_couples:
        return (
            "an in-batch loss term (contrastive pairs, or a normalisation over the batch): "
            "without dropout and in eval mode, one batch's loss is not the mean of its "
            "micro-batches' losses"
        )
    return UNKNOWN_CAUSE


def coupling(
    micro: Mapping[str, torch.Tensor],
    full: Mapping[str, torch.Tensor],
    *,
    model: torch.nn.Module,
    tolerance: float,
    effective_batch: int,
    k: int,
    micro_size: int,
    loss_couples: bool | None = None,
) -> BatchCoupling:
    """The batch-coupling verdict: the textbook gradient of k micro-batches against one
    batch of the effective size."""
    error = relative_error(micro, full)
    what = f"{k} micro-batches of {micro_size} vs one batch of {k * micro_size}"
    if math.isfinite(error) and error <= tolerance:
        return BatchCoupling(
            status="equivalent", relative_error=error, effective_batch=effective_batch, reason=what
        )
    return BatchCoupling(
        status="differs",
        relative_error=error,
        effective_batch=effective_batch,
        cause=coupling_cause(model, loss_couples),
        reason=what,
    )


def coupling_skipped(effective_batch: int, reason: str) -> BatchCoupling:
    return BatchCoupling(
        status="skipped", relative_error=None, effective_batch=effective_batch, reason=reason
    )


# ---------------------------------------------------------------------------- running
@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, tensors a model creates without a dtype are ``dtype``."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def to_dtype(batch: Any, dtype: torch.dtype | None, map_batch: Any) -> Any:
    """``batch`` with its floating-point tensors in ``dtype`` (None: unchanged)."""
    if dtype is None:
        return batch
    return map_batch(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient (full tensors under FSDP), detached copies."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad
            full = getattr(grad, "full_tensor", None)
            out[name] = (full() if callable(full) else grad).detach().clone()
    return out


def seed_all(seed: int) -> None:
    """Seed every random source a model's forward may draw from alike: torch's, Python's
    ``random`` and numpy's global generator (transformers' SpecAugment draws its masks from
    numpy), so that the plan's run and the textbook run see the same randomness outside
    the checkpointed layers too."""
    import random
    import sys

    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def textbook(
    model: torch.nn.Module,
    loss_fn: Any,
    pieces: Sequence[Any],
    seeds: Sequence[int],
    *,
    k: int,
    autocast: Any = None,
) -> dict[str, torch.Tensor]:
    """Gradients of ``pieces`` run the textbook way: no checkpointing, each micro-batch's
    ``loss / k`` back-propagated into the same gradients; each micro-batch after its seed.
    With ``k`` < len(pieces) the sum is divided by len(pieces) / k (data-parallel ranks
    averaging)."""
    model.zero_grad(set_to_none=True)
    for piece, seed in zip(pieces, seeds, strict=True):
        seed_all(seed)
        with autocast() if autocast is not None else contextlib.nullcontext():
            loss = loss_fn(model, piece)
        (loss / k).backward()
    grads = gradients(model)
    ranks = len(pieces) // k
    if ranks > 1:
        grads = {name: grad / ranks for name, grad in grads.items()}
    model.zero_grad(set_to_none=True)
    return grads


class StepCapture:
    """Wraps an optimizer's ``step``: counts the calls and keeps the gradients seen at the
    last one (before it can change or zero them)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.calls = 0
        self.grads: dict[str, torch.Tensor] = {}
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.grads = gradients(model)
            return original(*args, **kwargs)

        optimizer.step = step  # type: ignore[method-assign]


def step_count_failure(
    calls: int, k: int, tolerance: float, precision: str
) -> GradientCheck | None:
    """A failed check when the optimizer did not step exactly once per effective batch."""
    if calls == 1:
        return None
    return GradientCheck(
        status="fail",
        relative_error=None,
        tolerance=tolerance,
        precision=precision,
        reason=f"the optimizer stepped {calls} time(s) during one effective batch of {k} "
        "micro-batches (textbook: once, after the last)",
    )


def layer_set_failure(
    applied: Mapping[str, str], planned: Mapping[str, str], tolerance: float, precision: str
) -> GradientCheck | None:
    """A failed check when the run checkpointed other layers (or modes) than the plan."""
    if dict(applied) == dict(planned):
        return None
    extra = sorted(set(applied) - set(planned))
    missing = sorted(set(planned) - set(applied))
    changed = sorted(n for n in set(applied) & set(planned) if applied[n] != planned[n])
    parts = [
        f"{label} {', '.join(names[:3])}{' …' if len(names) > 3 else ''}"
        for label, names in (
            ("checkpointed outside the plan:", extra),
            ("not checkpointed:", missing),
            ("in another mode:", changed),
        )
        if names
    ]
    return GradientCheck(
        status="fail",
        relative_error=None,
        tolerance=tolerance,
        precision=precision,
        reason="the run did not apply the plan's layers (" + "; ".join(parts) + ")",
    )
