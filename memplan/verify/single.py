"""Run a plan for real and compare what it measures with what the plan predicted.

The run is the one a user would do: the model file's model and optimizer,
``memplan.apply(model, plan)``, and ``memplan.Accumulator`` stepping once per effective
batch, with fresh ``make_batch(micro_batch_size)`` batches. Memory is measured with the
probe's own live-tensor tracker (the instrument that fed the prediction) and, on CUDA, with
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after
``reset_peak_memory_stats`` and NVML's count of what the process holds.

It also checks that accumulation is equivalent to the full batch: the gradient after
``k`` micro-batches equals the gradient of one batch of ``k × micro`` samples, where that
can hold (not with BatchNorm, whose statistics are per micro-batch; every dropout is
switched off for the comparison, functional and fused included: ``run.no_dropout``)."""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from memplan import run
from memplan.errors import BadInputError, CannotMeasureError, checkpointing_failure
from memplan.files.schema import to_data
from memplan.model.loader import ModelFile, load_model_file
from memplan.plan import Plan
from memplan.probe.backends import make_backend
from memplan.probe.session import users_backward
from memplan.probe.tracker import resident_tensors
from memplan.units import format_bytes
from memplan.verify.grad_check import (
    TOLERANCE,
    BatchCoupling,
    GradientCheck,
    coupling_skipped,
    gradient_failure,
)
from memplan.verify.plan_check import check_gradients, micro_rows

GRAD_TOLERANCE = TOLERANCE  # the plan check's tolerance by precision (verify.grad_check)


class Verdict:
    """Pass/fail of a verify run, shared by the one-process and the multi-rank result:
    the measured peak within the budget, the peak error within tolerance, and the
    gradient check not failed."""

    __slots__ = ()

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.plan.budget_bytes

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[str]:
        """What failed, each named: the gradient check, the peak error, the budget."""
        out = []
        grad = self.gradient_check
        if grad.status == "fail":
            out.append(f"gradient check failed ({gradient_failure(grad)})")
        return out + self.peak_failures()

    def peak_failures(self) -> list[str]:
        """The peak error outside the tolerance, the peak over the budget (the multi-rank
        result names the rank of each)."""
        out = []
        if abs(self.peak_error) > self.tolerance:
            out.append(f"peak error {self.peak_error:+.1%} is outside ±{self.tolerance:.0%}")
        if not self.within_budget:
            out.append("measured peak is over the budget")
        return out

    def verdict_data(self) -> dict[str, Any]:
        """The verdict's derived fields, for ``--json``."""
        return {
            "within_budget": self.within_budget,
            "passed": self.passed,
            "failures": self.failures,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyResult(Verdict):
    plan: Plan
    device: str
    device_name: str
    steps: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    """Tracker peak over the first step (which creates the optimizer state) and ``steps``
    steady-state steps after it. On CUDA:
    what the process held at most (NVML, else max_memory_reserved)."""
    predicted_step_seconds: float
    measured_step_seconds: float
    """Median wall time of an optimizer step, each of ``steps`` steps timed alone, without
    the tracker."""
    tolerance: float
    effective_batch: int
    """Samples per optimizer step as the Accumulator reported it (× world size)."""
    gradient_check: GradientCheck
    """The plan check: the plan's run against the same micro-batches the textbook way."""
    batch_coupling: BatchCoupling
    """Whether micro-batching itself changes the objective (never fails the plan)."""
    tracker_peak_bytes: int
    step_seconds_samples: tuple[float, ...] = ()
    """Each timed optimizer step's wall time."""
    load_average: float | None = None
    """The machine's 1-minute load average when the steps were timed."""
    cpu_count: int = 1
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    nvml_process_bytes: int | None = None
    note: str = ""
    """How the comparison was adjusted, e.g. a CUDA plan measured on the CPU."""
    timeline: tuple[tuple[int, ...], ...] = ()
    """With ``record_timeline``: the tracker's live bytes after every op of the last
    measured optimizer step, one tuple per micro-step, then one for the optimizer step."""
    timeline_forward_ops: tuple[int | None, ...] = ()
    """Per micro-step of ``timeline``: how many of its ops ran before the model's forward
    returned (loss and backward follow); None where that was not seen."""

    @property
    def peak_error(self) -> float:
        """(predicted − measured) / measured: negative means memplan under-predicted."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(
            self.measured_peak_bytes, 1
        )

    @property
    def time_error(self) -> float:
        return (self.predicted_step_seconds - self.measured_step_seconds) / max(
            self.measured_step_seconds, 1e-12
        )

    @property
    def timing_caveat(self) -> str:
        """Why the time comparison is not meaningful here, or ''."""
        return timing_caveat(self.step_seconds_samples, self.load_average, self.cpu_count)

    def json_data(self) -> dict[str, Any]:
        """The result as JSON data with the verdict's derived fields; the per-op timeline is
        for ``--report``, not the JSON."""
        data = to_data(self)
        data.pop("timeline", None)
        data.update(
            peak_error=self.peak_error,
            time_error=self.time_error,
            timing_caveat=self.timing_caveat,
        )
        return {**data, **self.verdict_data()}


def predicted_for_device(plan: Plan, device: str) -> tuple[int, str]:
    """The predicted peak to compare with a run on ``device``, and why it differs from the
    plan's. A plan for a GPU carries a CUDA context and allocator reserve; a run elsewhere
    has neither, so it is compared with the tensor bytes alone."""
    reserve = plan.predicted.breakdown.reserve
    if device == "cuda" or reserve == 0:
        return plan.predicted.peak_bytes, ""
    return plan.predicted.peak_bytes - reserve, (
        f"the plan's CUDA reserve ({format_bytes(reserve)}) is left out: this run is on {device}"
    )


def _resolve_device(plan: Plan, device: str | None) -> str:
    if device is not None:
        chosen = device
    elif plan.device in ("cpu", "cuda"):
        chosen = plan.device
    else:
        chosen = "auto"
    if chosen == "meta":
        raise BadInputError(
            "verify runs the plan for real; --device meta has no memory to measure.",
            hint="Use --device cpu or --device cuda.",
        )
    return chosen


def fingerprint_note(plan: Plan, model: torch.nn.Module, model_ref: str) -> str:
    """Raise ``BadInputError`` when ``model`` is not the model ``plan`` was made for (its
    parameter bytes or checkpoint candidates differ); a note when the plan predates
    fingerprints and nothing could be checked, else ''."""
    from memplan.probe.layers import param_bytes

    recorded = plan.model_fingerprint
    if recorded is None:
        return (
            "the plan records no model fingerprint (written by an older memplan): nothing "
            f"checks that it was made for {model_ref}"
        )
    trainable, frozen = param_bytes(model)
    modules = {name for name, _ in model.named_modules()}
    missing = [name for name in recorded.candidate_layers if name not in modules]
    if trainable + frozen != recorded.parameter_bytes or missing:
        found = f"{model_ref} has {format_bytes(trainable + frozen)} of parameters"
        if missing:
            found += f" and no module {missing[0]!r}"
        raise BadInputError(
            f"The plan was made for another model: it records "
            f"{format_bytes(recorded.parameter_bytes)} of parameters and "
            f"{len(recorded.candidate_layers)} checkpoint candidates; {found}.",
            hint="Verify it with the model file it was solved for, or probe and solve this "
            "model again.",
        )
    return ""


def refuse_if_machine_too_small(plan: Plan, device: str) -> None:
    """CannotMeasureError (exit 3) before running a plan whose predicted peak exceeds what
    this machine has free: the run would be killed or fail in the user's code, which looks
    like the model file's fault."""
    from memplan.probe.runner import available_bytes

    need = predicted_for_device(plan, device)[0]
    have = available_bytes(device)
    if have is not None and need > have:
        raise CannotMeasureError(
            f"The plan needs {format_bytes(need)} per process on {device} and this machine "
            f"has {format_bytes(have)} available: it cannot be run here.",
            hint="Verify it on a machine (or GPU) with that much memory free, or solve for "
            "this one (e.g. --budget auto on it).",
        )


def _build(mf: ModelFile, device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return mf.build_model().to(device)


def _micro_batches(mf: ModelFile, micro: int, count: int) -> Any:
    for _ in range(count):
        yield mf.make_batch(micro)


def _run_steps(
    acc: run.Accumulator,
    mf: ModelFile,
    plan: Plan,
    steps: int,
    marks: list[int] | None = None,
    position: Callable[[], int] | None = None,
    bad_losses: list[str] | None = None,
) -> int:
    """Run ``steps`` optimizer steps; the effective batch the Accumulator reported. A loss
    that is not finite is noted in ``bad_losses`` (``max()`` and comparisons ignore NaN, so
    it must be looked for)."""
    effective = 0
    k = plan.accumulation_steps
    for i, batch in enumerate(_micro_batches(mf, plan.micro_batch_size, steps * k)):
        if marks is not None and position is not None:
            marks.append(position())
        with users_backward(mf):  # the forward's errors: ModelFile's own
            metrics = acc.step(batch, mf.loss)
        loss = metrics.get("micro_loss")
        if bad_losses is not None and isinstance(loss, float) and not math.isfinite(loss):
            bad_losses.append(f"the loss was {loss} at step {i // k + 1}, micro-batch {i % k + 1}")
        if metrics["stepped"]:
            effective = int(metrics["effective_batch"])
    return effective


def _non_finite(grads: dict[str, torch.Tensor]) -> str | None:
    """The first parameter whose gradient holds NaN or inf, named, else None."""
    for name, grad in grads.items():
        if not bool(torch.isfinite(grad).all()):
            kind = "NaN" if bool(torch.isnan(grad).any()) else "inf"
            return f"parameter {name} has {kind} in its gradient"
    return None


def verify_plan(
    model: str | ModelFile,
    plan: Plan,
    *,
    steps: int = 3,
    device: str | None = None,
    tolerance: float = 0.05,
    check_gradients: bool = True,
    seed: int = 0,
    on_progress: Callable[[int, int, str], None] | None = None,
    record_timeline: bool = False,
) -> VerifyResult:
    """Run ``steps`` optimizer steps of ``plan`` and measure them; see the module doc.
    ``record_timeline`` keeps the live bytes after every op of the last step (for
    ``memplan verify --report``)."""
    mf = model if isinstance(model, ModelFile) else load_model_file(model)
    mf = mf.at_seq_len(plan.seq_len)  # batches of the plan's length (issue 13)
    try:
        return _verify(
            mf, plan, steps, device, tolerance, check_gradients, seed, on_progress, record_timeline
        )
    except Exception as exc:
        known = checkpointing_failure(exc, mf.spec)
        if known is None:
            raise
        raise known from exc


def _verify(
    mf: ModelFile,
    plan: Plan,
    steps: int,
    device: str | None,
    tolerance: float,
    check_gradients: bool,
    seed: int,
    on_progress: Callable[[int, int, str], None] | None,
    record_timeline: bool,
) -> VerifyResult:
    if steps < 1:
        raise BadInputError(f"--steps must be at least 1, got {steps}.")
    if plan.world_size != 1:
        raise BadInputError(
            f"The plan is for {plan.world_size} ranks; --world-size 1 runs one process, "
            "whose memory and effective batch are not the plan's.",
            hint=f"Drop --world-size (or give --world-size {plan.world_size}) to verify it "
            "on its ranks, or solve again with --world-size 1 for a one-process plan.",
        )
    progress = on_progress or (lambda done, total, what: None)
    total = 3 + (1 if check_gradients else 0)
    backend = make_backend(_resolve_device(plan, device), plan.precision, None)
    torch_device = backend.torch_device
    refuse_if_machine_too_small(plan, backend.device)

    if check_gradients:  # a batch its check cannot cut is refused before any run
        micro_rows(mf, plan)
    progress(0, total, "building the model")
    net = _build(mf, torch_device, seed)
    fingerprint = fingerprint_note(plan, net, mf.reference or str(mf.path))
    optimizer = mf.make_optimizer(net)
    run.apply(net, plan)
    acc = run.Accumulator(net, optimizer, plan, device=torch_device)
    cuda = backend.device == "cuda"
    bad_losses: list[str] = []
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        progress(1, total, f"measuring 1 + {steps} step(s)")
        tracker = backend.tracker(record=record_timeline)
        tracker.track(resident_tensors(net, optimizer, None))
        marks: list[int] = []
        step_marks: list[int] = []
        forward_marks: list[int] = []
        hook = optimizer.register_step_pre_hook(lambda *_: step_marks.append(tracker.position))
        fwd_hook = net.register_forward_hook(lambda *_: forward_marks.append(tracker.position))
        with tracker:
            # The first step creates the optimizer state, so it runs without it; the
            # prediction is of the steady state. Measure it and ``steps`` more.
            effective = _run_steps(
                acc, mf, plan, steps + 1, marks, lambda: tracker.position, bad_losses
            )
        hook.remove()
        fwd_hook.remove()
        timeline, forward_ops = (
            last_step_timeline(
                tracker.values, marks, step_marks, plan.accumulation_steps, forward_marks
            )
            if record_timeline
            else ((), ())
        )
        cuda_alloc = torch.cuda.max_memory_allocated() if cuda else None
        cuda_reserved = torch.cuda.max_memory_reserved() if cuda else None
        progress(2, total, f"timing {steps} step(s)")
        samples = []
        for _ in range(steps):
            start = backend.clock()
            _run_steps(acc, mf, plan, 1)
            samples.append(backend.clock() - start)
        seconds = statistics.median(samples)
    except torch.OutOfMemoryError as exc:
        raise CannotMeasureError(
            f"Out of GPU memory running the plan (micro-batch {plan.micro_batch_size} × "
            f"{plan.accumulation_steps}, {len(plan.checkpoint_layers)} checkpointed layers).",
            hint="The plan does not fit this GPU: measured peak exceeds what is free. "
            "Solve again with a smaller --budget or --budget auto.",
        ) from exc

    nvml_bytes = None
    measured = tracker.peak_bytes
    if cuda:
        from memplan.devices import local_gpu

        info = local_gpu(torch_device.index or 0)
        nvml_bytes = info.process_used_bytes if info else None
        measured = nvml_bytes if nvml_bytes is not None else int(cuda_reserved or 0)

    del acc, optimizer, net
    progress(3, total, "gradient check")
    grad, couple = _gradient_checks(mf, plan, torch_device, seed, bad_losses, check_gradients)
    progress(total, total, "done")
    predicted, note = predicted_for_device(plan, backend.device)
    note = "; ".join(n for n in (note, fingerprint) if n)
    return VerifyResult(
        plan=plan,
        device=backend.device,
        device_name=backend.device_name(),
        steps=steps,
        predicted_peak_bytes=predicted,
        note=note,
        measured_peak_bytes=int(measured),
        predicted_step_seconds=plan.predicted.step_seconds,
        measured_step_seconds=seconds,
        tolerance=tolerance,
        effective_batch=effective,
        gradient_check=grad,
        batch_coupling=couple,
        step_seconds_samples=tuple(samples),
        load_average=load_average(),
        cpu_count=os.cpu_count() or 1,
        tracker_peak_bytes=tracker.peak_bytes,
        cuda_max_allocated_bytes=cuda_alloc,
        cuda_max_reserved_bytes=cuda_reserved,
        nvml_process_bytes=nvml_bytes,
        timeline=timeline,
        timeline_forward_ops=forward_ops,
    )


def _gradient_checks(
    mf: ModelFile,
    plan: Plan,
    device: torch.device,
    seed: int,
    bad_losses: list[str],
    asked: bool,
) -> tuple[GradientCheck, BatchCoupling]:
    """The plan check and the batch coupling, unless a loss of the run was not finite or
    the check was not asked for."""
    tol = GRAD_TOLERANCE[plan.precision]
    effective = plan.accumulation_steps * plan.micro_batch_size
    if bad_losses or not asked:
        reason = (
            f"{bad_losses[0]} while running the plan"
            if bad_losses
            else "not asked for (--no-grad-check)"
        )
        grad = GradientCheck(
            status="fail" if bad_losses else "skipped",
            relative_error=None,
            tolerance=tol,
            reason=reason,
        )
        return grad, coupling_skipped(effective, reason)
    with users_backward(mf):
        return check_gradients(mf, plan, device, seed)


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def last_step_timeline(
    values: list[int],
    micro_marks: list[int],
    step_marks: list[int],
    accumulation_steps: int,
    forward_marks: list[int] = (),
) -> tuple[tuple[tuple[int, ...], ...], tuple[int | None, ...]]:
    """Cut the last optimizer step out of a recorded run: ``micro_marks`` are the positions
    where each micro-step began, ``step_marks`` where each optimizer step began,
    ``forward_marks`` where the model's forward returned. Returns the pieces (micro-steps,
    then the optimizer step) and, per micro-step, its ops before the forward returned."""
    if len(micro_marks) < accumulation_steps or not step_marks:
        return (), ()
    starts = [*micro_marks[-accumulation_steps:], step_marks[-1]]
    pieces = [tuple(values[a:b]) for a, b in itertools.pairwise(starts)]
    forward_ops = tuple(
        max((m - a for m in forward_marks if a <= m < b), default=None)
        for a, b in itertools.pairwise(starts)
    )
    return (*pieces, tuple(values[step_marks[-1] :])), forward_ops


STEP_SPREAD_LIMIT = 0.25
"""(slowest − fastest) / median of the timed steps above which one step time means little."""


def timing_caveat(samples: Iterable[float], load_average: float | None, cpu_count: int) -> str:
    """Why measured step times cannot judge the predicted one, or '': the machine's load
    above its cores (other work took the CPU) or the timed steps spreading by more than
    ``STEP_SPREAD_LIMIT`` of their median."""
    times = sorted(samples)
    reasons = []
    if load_average is not None and load_average > cpu_count:
        reasons.append(f"the machine's load {load_average:.1f} exceeds its {cpu_count} core(s)")
    if len(times) >= 2:
        median = (
            times[len(times) // 2]
            if len(times) % 2
            else sum(times[len(times) // 2 - 1 : len(times) // 2 + 1]) / 2
        )
        spread = (times[-1] - times[0]) / median if median > 0 else 0.0
        if spread > STEP_SPREAD_LIMIT:
            reasons.append(f"the {len(times)} timed steps spread by {spread:.0%} of their median")
    return " and ".join(reasons)
