"""Run real training steps of a plan-like configuration and measure their peak.

The peak comes from the same live-tensor tracker the probe uses (and, on CUDA, from
``torch.cuda.max_memory_allocated``/``max_memory_reserved`` too), so ``verify`` compares a
prediction with a measurement made by the same instrument that fed it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from memplan.errors import BadInputError, CannotMeasureError
from memplan.model.loader import ModelFile, load_model_file
from memplan.modes import FULL, KEEP
from memplan.probe.backends import make_backend
from memplan.probe.session import run_backward
from memplan.probe.tracker import resident_tensors
from memplan.run.checkpoint import checkpointed, in_mode
from memplan.run.training_state import disable_kv_cache


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredRun:
    peak_bytes: int
    """Largest live tensor bytes over the tracked steps (params, grads, optimizer state,
    activations, the batch): what the profile's timeline predicts."""
    seconds_per_step: float
    """Mean wall time of one optimizer step (all its micro-steps), measured without the
    tracker; on meta, roofline time."""
    micro_batch: int
    accumulation_steps: int
    checkpoint_layers: tuple[str, ...]
    precision: str
    device: str
    steps: int
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None


def measure_training_peak(
    model_file: str | Path | ModelFile,
    device: str = "auto",
    micro_batch: int = 1,
    accumulation_steps: int = 1,
    checkpoint_layers: Iterable[str] = (),
    precision: str = "fp32",
    steps: int = 2,
    *,
    device_profile: str | None = None,
    checkpoint_modes: Mapping[str, str] | None = None,
) -> MeasuredRun:
    """``steps`` real optimizer steps (each: zero_grad(set_to_none=True), then
    ``accumulation_steps`` micro-steps of ``micro_batch`` samples with the loss scaled by
    1/accumulation, then ``optimizer.step()``) after one warm-up step, with the named
    modules checkpointed (non-reentrant), or each module of ``checkpoint_modes`` in its mode
    (memplan.modes). Returns the tracker's peak and the step time."""
    if micro_batch < 1 or accumulation_steps < 1 or steps < 1:
        raise BadInputError("micro_batch, accumulation_steps and steps must be positive.")
    mf = model_file if isinstance(model_file, ModelFile) else load_model_file(str(model_file))
    backend = make_backend(device, precision, device_profile)
    model = backend.build(mf)
    disable_kv_cache(model)  # as the probe and memplan.apply do
    optimizer = mf.make_optimizer(model)
    modules = dict(model.named_modules())
    modes = dict(checkpoint_modes) if checkpoint_modes is not None else {}
    names = tuple(modes) if checkpoint_modes is not None else tuple(checkpoint_layers)
    full = [n for n in names if modes.get(n, FULL) == FULL]
    unknown = [n for n in names if n not in modules or not n]
    if unknown:
        raise BadInputError(
            f"checkpoint layer(s) {', '.join(map(repr, unknown))} are not modules of the model "
            f"from {mf.spec}.",
            hint="Use fully-qualified module names, as in the profile.",
        )
    batch = backend.batch(mf, micro_batch)
    scale = 1.0 / accumulation_steps

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulation_steps):
            with backend.forward_context():
                loss = mf.loss(model, batch)
                if accumulation_steps > 1:
                    loss = loss * scale
            run_backward(mf, loss)
            del loss
        optimizer.step()

    try:
        with (
            checkpointed((modules[n] for n in full), context_fn=backend.checkpoint_context_fn()),
            ExitStack() as stack,
        ):
            for mode in sorted(set(modes.values()) - {FULL, KEEP}):
                chosen = [modules[n] for n, m in modes.items() if m == mode]
                stack.enter_context(
                    in_mode(chosen, mode, context_fn=backend.checkpoint_context_fn())
                )
            with backend.guard():
                one_step()  # warm-up: optimizer state exists from here on
            if backend.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            tracker = backend.tracker(record=False)
            tracker.track(resident_tensors(model, optimizer, batch))
            with tracker:
                for _ in range(steps):
                    one_step()
            cuda_alloc = torch.cuda.max_memory_allocated() if backend.device == "cuda" else None
            cuda_reserved = torch.cuda.max_memory_reserved() if backend.device == "cuda" else None
            if backend.device == "meta":
                seconds = tracker.virtual_seconds / steps
            else:
                t0 = backend.clock()
                for _ in range(steps):
                    one_step()
                seconds = (backend.clock() - t0) / steps
    except torch.OutOfMemoryError as exc:
        raise CannotMeasureError(
            f"Out of GPU memory running micro-batch {micro_batch} × {accumulation_steps} "
            f"with {len(names)} checkpointed layer(s).",
            hint="The plan does not fit this GPU; solve again with a smaller --budget.",
        ) from exc
    return MeasuredRun(
        peak_bytes=tracker.peak_bytes,
        seconds_per_step=seconds,
        micro_batch=micro_batch,
        accumulation_steps=accumulation_steps,
        checkpoint_layers=names,
        precision=precision,
        device=backend.device,
        steps=steps,
        cuda_max_allocated_bytes=cuda_alloc,
        cuda_max_reserved_bytes=cuda_reserved,
    )
