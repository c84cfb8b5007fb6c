"""Run the measured micro-steps and turn them into a ``memplan.profile.Profile``.

Per probed micro-batch size, after a warm-up step (so optimizer state exists):
phase ``no_grads`` (gradients set to None), phase ``grads_resident`` (again, without
zeroing), the optimizer step; one untracked micro-step and optimizer step for times (the
tracker's own overhead stays out of them); then both phases again with every candidate
layer checkpointed, and (not on meta) again with every layer under selective checkpointing
(memplan.modes), so that any mix of keep, selective and full is predicted exactly. Each point of each segment is fitted across sizes (profile.py's module
docstring says how the solver reads them).
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

import memplan
import memplan.runtime
from memplan.devices import local_gpu
from memplan.errors import BadInputError, CannotMeasureError, checkpointing_failure
from memplan.loader import ModelFile, batch_tensors, load_model_file
from memplan.modes import SELECTIVE
from memplan.probe.backends import Backend, make_backend
from memplan.probe.checkpointing import checkpointed, in_mode
from memplan.probe.dedup import ForwardMisses
from memplan.probe.fitting import add_affine, fit_affine, fit_seconds, sum_affine, undominated
from memplan.probe.layers import (
    default_layers,
    fixed_parts,
    glob_layers,
    has_batchnorm,
    own_params_owners,
    param_bytes,
)
from memplan.probe.nonfinite import where_nonfinite
from memplan.probe.recorder import Recorder, StepRecord
from memplan.probe.tracker import LiveTracker, resident_tensors, state_tensors, storages_bytes
from memplan.profile import (
    Affine,
    Environment,
    FixedPart,
    Layer,
    ModelRef,
    Point,
    Profile,
    Segment,
    Totals,
)
from memplan.units import format_bytes

AFFINE_TOLERANCE = 0.01
TIMING_REPEATS = 3
TIMING_EXTRA_FACTOR = 4
"""Times (only) are also taken at this multiple of the largest probed size."""
"""A byte quantity whose fit misses a measured size by more than 1% is flagged non-affine."""

Progress = Callable[[int, int, str], None]
Series = tuple[list[int], list[str]]

LAYOUT_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "clone", "contiguous", "expand",
    "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze", "slice", "select",
    "detach", "alias", "copy_", "empty_like", "_to_copy", "split", "split_with_sizes",
})  # fmt: skip
"""Ops whose presence can depend on the batch size without data-dependent routing: a
reshape of a size-1 dimension is a view at micro-batch 1 and a copy above it."""


@dataclass(slots=True)
class Run:
    """One tracked micro-step (or optimizer step)."""

    record: StepRecord | None
    values: list[int]
    peak_bytes: int
    virtual_seconds: float = 0.0
    ops: list[str] = field(default_factory=list)

    def segments(self) -> list[tuple[tuple[int, str], Series]]:
        """Per segment, in execution order: its key and its (live bytes, op names), the
        first entry being the boundary itself."""
        assert self.record is not None
        marks = self.record.marks
        out = []
        for k, mark in enumerate(marks):
            end = marks[k + 1].pos if k + 1 < len(marks) else len(self.values)
            values = [mark.live, *self.values[mark.pos : end]]
            ops = ["<boundary>", *self.ops[mark.pos : end]]
            out.append(((mark.held, mark.active), (values, ops)))
        return out


@dataclass(slots=True)
class SizeRuns:
    size: int
    no_grads: Run
    grads_resident: Run
    optimizer: Run
    timing: StepRecord
    optimizer_seconds: float
    ckpt_no_grads: Run
    ckpt_grads_resident: Run
    grads: dict[int, int]
    """Gradient bytes per parameter (by id), from the real gradients."""
    state: dict[int, int]
    """Optimizer-state bytes per parameter (by id), after a real optimizer step."""
    ckpt_timing: StepRecord | None = None
    """Untracked all-checkpointed micro-step (None on meta: no real times)."""
    batch_bytes: int = 0
    """Bytes of the batch's tensors (made on the host by ``make_batch``)."""
    sel_no_grads: Run | None = None
    sel_grads_resident: Run | None = None
    """Both phases with every layer under selective checkpointing (None on meta)."""
    sel_timing: StepRecord | None = None
    """Untracked all-selective micro-step (None on meta)."""


@dataclass(slots=True)
class Session:
    """A model, its optimizer and the hooks, on one backend."""

    model_file: ModelFile
    backend: Backend
    model: torch.nn.Module
    optimizer: Any
    layer_names: list[str]
    layers: list[torch.nn.Module]
    part_names: list[str]
    recorder: Recorder
    warnings: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------------ stepping
    def micro_step(
        self, batch: Any, tracker: LiveTracker | None, *, scale: float = 1.0
    ) -> StepRecord:
        """Forward and backward of one micro-batch; the loss is dropped before returning."""
        recorder = self.recorder
        recorder.clock = lambda: self.backend.clock(tracker)
        recorder.begin(tracker)
        with self.backend.forward_context():
            loss = self.model_file.loss(self.model, batch)
            if scale != 1.0:
                loss = loss * scale
        recorder.forward_done()
        bad = None
        if loss.device.type != "meta" and not bool(torch.isfinite(loss.detach())):
            bad = float(loss.detach())
        loss.backward()
        del loss
        record = recorder.end()
        if bad is not None:
            self._warn_loss(bad, batch)
        return record

    def _warn_loss(self, value: float, batch: Any) -> None:
        """A NaN or infinite loss is measured all the same (the memory is real) but named:
        a plan trained on it learns nothing. The first one also says where it arose
        (memplan.probe.nonfinite): one more forward of the batch, before the optimizer
        steps on NaN gradients and every later loss is NaN because the weights are, run
        unseen by the tracker (its dispatch mode is set aside) and by the recorder (a
        record of its own, thrown away)."""
        sizes = [t.shape[0] for t in batch_tensors(batch) if t.dim() > 0]
        size = f"micro-batch {sizes[0]}" if sizes else "a micro-batch"
        head = (
            f"The training loss was {value} at {size} during the probe (a probe step of "
            f"{self.model_file.spec})"
        )
        tail = (
            "; check the model and make_batch for that size (e.g. statistics over a batch of one)."
        )
        first = not any(w.startswith("The training loss was ") for w in self.warnings)
        if any(w.startswith(head) for w in self.warnings):
            return
        where = (
            None if first else "after an earlier non-finite step, whose NaN the weights may hold"
        )
        if first:
            clock = self.recorder.clock
            with _disable_current_modes():
                self.recorder.begin(None)
                try:
                    with self.backend.forward_context():
                        where = where_nonfinite(self.model, self.model_file.loss, batch)
                finally:
                    self.recorder.end()
                    self.recorder.clock = clock
        self.warnings.append(f"{head}: {where}{tail}" if where else head + tail)

    def tracked_step(self, batch: Any) -> Run:
        tracker = self.backend.tracker()
        tracker.track(resident_tensors(self.model, self.optimizer, batch))
        with tracker:
            record = self.micro_step(batch, tracker)
        return Run(record, tracker.values, tracker.peak_bytes, tracker.virtual_seconds, tracker.ops)

    def tracked_optimizer_step(self, batch: Any) -> Run:
        tracker = self.backend.tracker(record=False)
        tracker.track(resident_tensors(self.model, self.optimizer, batch))
        with tracker:
            self.optimizer.step()
        return Run(None, [], tracker.peak_bytes, tracker.virtual_seconds)

    def timed_optimizer_step(self) -> float:
        t0 = self.backend.clock()
        self.optimizer.step()
        return self.backend.clock() - t0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _resolve_layers(model: torch.nn.Module, layers: str | None) -> list[str]:
    return glob_layers(model, layers) if layers else default_layers(model)


def open_session(model_file: ModelFile, backend: Backend, layers: str | None) -> Session:
    model = backend.build(model_file)
    # The probe checkpoints every candidate; memplan.apply does the same for every plan.
    cache_note = memplan.runtime.kv_cache_note(memplan.runtime.disable_kv_cache(model))
    optimizer = model_file.make_optimizer(model)
    names = _resolve_layers(model, layers)
    modules = dict(model.named_modules())
    parts = fixed_parts(model, names)
    recorder = Recorder(
        model, [modules[n] for n in names], {n: modules[n] for n in parts}, clock=backend.clock
    )
    recorder.install()
    return Session(
        model_file=model_file,
        backend=backend,
        model=model,
        optimizer=optimizer,
        layer_names=names,
        layers=[modules[n] for n in names],
        part_names=parts,
        recorder=recorder,
        warnings=[cache_note] if cache_note else [],
    )


def warm_up(session: Session, size: int) -> None:
    """One full training step (so optimizer state exists); also finds the order in which
    the layers run, and re-hooks them in that order."""
    batch = session.backend.batch(session.model_file, size)
    session.zero_grad()
    with session.backend.guard():
        record = session.micro_step(batch, None)
        session.optimizer.step()
    session.zero_grad()
    order = record.layer_order
    if len(order) != len(session.layer_names) or order != sorted(order):
        missing = [
            session.layer_names[i] for i in range(len(session.layer_names)) if i not in order
        ]
        if missing:
            session.warnings.append(
                f"{len(missing)} candidate layer(s) never ran and are left out: "
                + ", ".join(missing[:5])
            )
        names = [session.layer_names[i] for i in order]
        modules = dict(session.model.named_modules())
        session.recorder.remove()
        session.layer_names = names
        session.layers = [modules[n] for n in names]
        session.recorder = Recorder(
            session.model,
            session.layers,
            {n: modules[n] for n in session.part_names},
            clock=session.backend.clock,
        )
        session.recorder.install()
    if record.problems:
        raise CannotMeasureError(
            f"{session.model_file.path}: {record.problems[0]}; a checkpoint candidate must run "
            "once per micro-step.",
            hint="Choose other layers with --layers GLOB.",
        )


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


@dataclass(slots=True)
class TimedSize:
    """Untracked times at one size: a plain micro-step, the same with every layer
    checkpointed (what checkpointing costs, measured), and an optimizer step."""

    size: int
    timing: StepRecord
    optimizer_seconds: float
    ckpt_timing: StepRecord | None
    sel_timing: StepRecord | None = None


def _median_record(session: Session, batch: Any) -> StepRecord:
    """One timed run is at the mercy of whatever else the machine does; the run with the
    median total time of TIMING_REPEATS keeps per-layer times of one consistent run."""
    records = []
    for _ in range(TIMING_REPEATS):
        session.zero_grad()
        records.append(session.micro_step(batch, None))
    records.sort(key=lambda r: r.t_end - r.t_start)
    return records[len(records) // 2]


def time_size(
    session: Session, batch: Any
) -> tuple[StepRecord, float, StepRecord, StepRecord | None]:
    """Untracked, so the tracker's overhead stays out of the times: plain, optimizer step,
    all-checkpointed and all-selective (None on meta) micro-steps."""
    with checkpointed(session.layers, context_fn=session.backend.checkpoint_context_fn()):
        ckpt = _median_record(session, batch)
    selective = None
    if session.backend.device != "meta":
        with in_mode(session.layers, SELECTIVE):
            selective = _median_record(session, batch)
    plain = _median_record(session, batch)
    optimizer_seconds = statistics.median(
        session.timed_optimizer_step() for _ in range(TIMING_REPEATS)
    )
    session.zero_grad()
    return plain, optimizer_seconds, ckpt, selective


def time_extra_size(session: Session, size: int) -> TimedSize | None:
    """Times only (no tracking) at a size above the probed ones. At the small sizes a probe
    uses, a layer's time is mostly fixed overhead and its growth per sample is lost in
    noise; one larger size makes the per-sample slope a measurement, not an extrapolation.
    Skipped (None) when it does not fit the device."""
    try:
        batch = session.backend.batch(session.model_file, size)
        timing, optimizer_seconds, ckpt_timing, sel_timing = time_size(session, batch)
    except torch.OutOfMemoryError:
        session.zero_grad()
        gc.collect()
        torch.cuda.empty_cache()
        return None
    return TimedSize(size, timing, optimizer_seconds, ckpt_timing, sel_timing)


def available_bytes(device: str) -> int | None:
    """What a micro-step may still allocate: free GPU memory on cuda, the host's available
    memory on cpu and meta (meta allocates nothing but the batch, which is on the host)."""
    from memplan.devices import host_available_bytes, local_gpu

    if device == "cuda":
        info = local_gpu(torch.cuda.current_device())
        return info.free_bytes if info else None
    return host_available_bytes()


def estimated_bytes(session: Session, first: SizeRuns, size: int) -> tuple[float, str]:
    """A linear estimate of what micro-batch ``size`` will allocate, from the first probed
    size: the live bytes above the start of its step scale with the batch (on meta only
    the host batch is real). Used to refuse a size before allocating it, not to plan."""
    return _scaled_bytes(session, first.size, first.no_grads, first.batch_bytes, size)


def _scaled_bytes(
    session: Session, measured_size: int, run: Run, batch_bytes: int, size: int
) -> tuple[float, str]:
    scale = size / measured_size
    if session.backend.device == "meta":
        return batch_bytes * scale, "for the batch on the host"
    start = run.values[0] if run.values else 0
    return start + max(run.peak_bytes - start, 0) * scale, ""


def _refuse(session: Session, size: int, need: float, what: str, source: str) -> None:
    have = available_bytes(session.backend.device)
    if have is not None and need > have:
        raise BadInputError(
            f"--micro-batches: size {size} would need about {format_bytes(int(need))} "
            f"{what or 'on ' + session.backend.device} ({source}), and only "
            f"{format_bytes(have)} is available.",
            hint="Probe smaller sizes (e.g. --micro-batches 1,2,4): the fits extrapolate "
            "to larger micro-batches.",
        )


def refuse_unfit_size(session: Session, first: SizeRuns, size: int) -> None:
    """BadInputError when micro-batch ``size`` cannot fit this machine (estimated from the
    first probed size), rather than letting the kernel kill the process."""
    need, what = estimated_bytes(session, first, size)
    _refuse(session, size, need, what, f"scaled from micro-batch {first.size}")


CALIBRATION_SIZE = 2
"""The micro-batch of the step that sizes up a larger first ``--micro-batches`` size."""


def refuse_unfit_first_size(session: Session, size: int) -> None:
    """The same refusal for the first size, before anything runs at it: one tracked
    forward and backward at micro-batch ``CALIBRATION_SIZE`` (2, not 1, so that BatchNorm
    over a batch still trains), scaled as ``refuse_unfit_size`` scales. Nothing to do for
    sizes up to that one, or when the model cannot take a batch of 2. The calibration step
    leaves no gradients behind."""
    if size <= CALIBRATION_SIZE:
        return
    warnings = list(session.warnings)  # the probed sizes will say what this step would
    try:
        batch = session.backend.batch(session.model_file, CALIBRATION_SIZE)
        batch_bytes = sum(t.numel() * t.element_size() for t in batch_tensors(batch))
        run = Run(None, [], 0)  # on meta only the host batch is real: no step needed
        if session.backend.device != "meta":
            session.zero_grad()
            run = session.tracked_step(batch)
        del batch
    except Exception:  # a model that takes no batch of 2: the real sizes say what is wrong
        return
    finally:
        session.zero_grad()
        session.warnings[:] = warnings
    need, what = _scaled_bytes(session, CALIBRATION_SIZE, run, batch_bytes, size)
    _refuse(session, size, need, what, f"scaled from a step at micro-batch {CALIBRATION_SIZE}")


def run_size(session: Session, size: int, tick: Callable[[str], None]) -> SizeRuns:
    backend, mf = session.backend, session.model_file
    batch = backend.batch(mf, size)
    session.zero_grad()
    no_grads = session.tracked_step(batch)
    tick(f"b={size}: no_grads")
    grads_resident = session.tracked_step(batch)
    tick(f"b={size}: grads_resident")
    optimizer = session.tracked_optimizer_step(batch)
    grads, state = _grad_and_state_bytes(session.model, session.optimizer)
    tick(f"b={size}: optimizer step")
    session.zero_grad()
    ckpt_timing = sel_timing = None
    if backend.device == "meta":
        timing, optimizer_seconds = no_grads.record, optimizer.virtual_seconds
    else:
        timing, optimizer_seconds, ckpt_timing, sel_timing = time_size(session, batch)
    tick(f"b={size}: timing")
    with checkpointed(session.layers, context_fn=backend.checkpoint_context_fn()):
        ckpt_no_grads = session.tracked_step(batch)
        tick(f"b={size}: checkpointed no_grads")
        ckpt_grads_resident = session.tracked_step(batch)
        tick(f"b={size}: checkpointed grads_resident")
    session.zero_grad()
    sel_no_grads = sel_grads_resident = None
    if backend.device != "meta":
        with in_mode(session.layers, SELECTIVE):
            sel_no_grads = session.tracked_step(batch)
            sel_grads_resident = session.tracked_step(batch)
        tick(f"b={size}: selective")
        session.zero_grad()
    assert timing is not None
    return SizeRuns(
        size,
        no_grads,
        grads_resident,
        optimizer,
        timing,
        optimizer_seconds,
        ckpt_no_grads,
        ckpt_grads_resident,
        grads,
        state,
        ckpt_timing,
        sum(t.numel() * t.element_size() for t in batch_tensors(batch)),
        sel_no_grads,
        sel_grads_resident,
        sel_timing,
    )


# --------------------------------------------------------------------------- assembling
def _fit(sizes: Sequence[int], values: Sequence[float]) -> Affine:
    return fit_affine(list(sizes), [float(v) for v in values])


def _layer_seconds(record: StepRecord, j: int) -> float:
    """Forward plus backward of layer j in one timed micro-step."""
    x = record.layers[j]
    return x.fwd_t1 - x.fwd_t0 + _bwd_seconds(x.bwd_t0, x.bwd_t1)


def _fit_time(sizes: Sequence[int], values: Sequence[float]) -> Affine:
    return fit_seconds(list(sizes), [float(v) for v in values])


def _align(ref_ops: list[str], values: list[int], ops: list[str]) -> list[tuple[int, bool]] | None:
    """``values`` (of a smaller size) aligned to the ops of the largest size, each with
    whether this size really ran that op. Where the two differ only by layout ops (a
    reshape that is a view at micro-batch 1 and a copy above it), a missing op gets the
    live bytes after the differing stretch (a view allocates nothing). None when they differ
    in anything else: the op sequence depends on the data."""
    if ops == ref_ops:
        return [(v, True) for v in values]
    out: list[tuple[int, bool]] = []
    matcher = difflib.SequenceMatcher(None, ref_ops, ops, autojunk=False)
    for tag, a1, a2, b1, b2 in matcher.get_opcodes():
        if tag == "equal":
            out.extend((v, True) for v in values[b1:b2])
        elif any(op not in LAYOUT_OPS for op in (*ref_ops[a1:a2], *ops[b1:b2])):
            return None
        else:
            after = values[b2 - 1] if b2 > b1 else values[max(b1 - 1, 0)]
            out.extend([(after, False)] * (a2 - a1))
    return out


def _fit_series(
    sizes: Sequence[int], series: Sequence[Series], excluded: set[int]
) -> tuple[list[Point], bool]:
    """Fit point i across sizes, aligned on the largest size's ops. A point that a size
    lacks is fitted from the sizes that have it when there are two; else from all, with the
    live bytes the lacking size had there (which over-estimates the slope: safe). When the
    sequences differ in more than layout ops the op sequence depends on the data: the
    segment maximum is fitted instead (second result False)."""
    _, ref_ops = series[-1]
    aligned = [_align(ref_ops, values, ops) for values, ops in series]
    if any(a is None for a in aligned):
        return _fit_series_maxima(sizes, series), False
    points = []
    for column in zip(*aligned, strict=True):  # type: ignore[misc]
        have = [(b, v) for b, (v, real) in zip(sizes, column, strict=True) if real]
        if len(have) < len(sizes):
            excluded.update(b for b, (_, real) in zip(sizes, column, strict=True) if not real)
            if len(have) < 2:
                have = [(b, v) for b, (v, _) in zip(sizes, column, strict=True)]
        fit = _fit([b for b, _ in have], [v for _, v in have])
        points.append((fit.intercept, fit.slope))
    return points, True


def _fit_series_maxima(sizes: Sequence[int], series: Sequence[Series]) -> list[Point]:
    fit = _fit(sizes, [max(values) for values, _ in series])
    return [(fit.intercept, fit.slope)]


def _nth_occurrences(
    segments: list[tuple[tuple[int, str], Series]],
) -> dict[tuple[int, str, int], Series]:
    seen: dict[tuple[int, str], int] = {}
    out = {}
    for key, values in segments:
        n = seen.get(key, 0)
        seen[key] = n + 1
        out[(*key, n)] = values
    return out


def _timeline(
    sizes: list[int],
    plain: list[Run],
    ckpt: list[Run],
    savings: list[Affine],
    warnings: list[str],
    selective: list[Run] | None = None,
    selective_savings: list[Affine] | None = None,
) -> tuple[tuple[Segment, ...], bool]:
    per_size = [run.segments() for run in plain]
    keys = [[key for key, _ in segs] for segs in per_size]
    stable = True
    if any(k != keys[0] for k in keys):
        # Different boundaries per size: align by (segment, occurrence) where possible.
        warnings.append(
            "The layer boundaries differed between probed sizes; segments were "
            "aligned by occurrence."
        )
        stable = False
    plain_occ = [_nth_occurrences(segs) for segs in per_size]
    ckpt_occ = [_nth_occurrences(run.segments()) for run in ckpt]
    sel_occ = [_nth_occurrences(run.segments()) for run in selective] if selective else None
    order = list(plain_occ[-1].keys())
    excluded: set[int] = set()
    segments = []
    for occ in order:
        held, active, _ = occ
        if not all(occ in p for p in plain_occ):
            stable = False
            continue
        points, ok = _fit_series(sizes, [p[occ] for p in plain_occ], excluded)
        stable &= ok
        ckpt_points: tuple[Point, ...] = ()
        if active != "none":
            if all(occ in c for c in ckpt_occ):
                raw, ok = _fit_series(sizes, [c[occ] for c in ckpt_occ], excluded)
                stable &= ok
                shift = sum_affine(savings[:held])
                ckpt_points = undominated([add_affine(p, shift) for p in raw])
            else:
                warnings.append(
                    f"segment held={held} {active} is missing from the "
                    "checkpointed run; its no-checkpoint points are used."
                )
                ckpt_points = undominated(points)
        sel_points: tuple[Point, ...] = ()
        if active != "none" and sel_occ is not None and selective_savings is not None:
            if all(occ in c for c in sel_occ):
                raw, ok = _fit_series(sizes, [c[occ] for c in sel_occ], excluded)
                stable &= ok
                shift = sum_affine(selective_savings[:held])
                sel_points = undominated([add_affine(p, shift) for p in raw])
            else:
                sel_points = undominated(points)
        segments.append(
            Segment(
                held=held,
                active=active,
                points=undominated(points),
                ckpt_points=ckpt_points,
                selective_points=sel_points,
            )
        )
    if excluded:
        warnings.append(
            f"Micro-batch {', '.join(map(str, sorted(excluded)))} runs different layout ops "
            "(a reshape that is a view only at that size); points it lacks were fitted from "
            "the other sizes."
        )
    return tuple(segments), stable


def _window_peak(values: list[int], start: int, stop: int, base: int) -> int:
    window = values[start:stop] if 0 <= start <= stop else []
    return max([base, *window]) - base


def _grad_and_state_bytes(
    model: torch.nn.Module, optimizer: Any
) -> tuple[dict[int, int], dict[int, int]]:
    grads = {id(p): storages_bytes([p.grad]) for p in model.parameters() if p.grad is not None}
    state = {}
    for p in model.parameters():
        if p in optimizer.state:
            state[id(p)] = storages_bytes(state_tensors(optimizer.state[p]))
    return grads, state


def _unique_params(module: torch.nn.Module, *, recurse: bool = True) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in module.parameters(recurse=recurse)}.values())


def _bwd_seconds(t0: float | None, t1: float | None) -> float:
    return (t1 - t0) if t0 is not None and t1 is not None else 0.0


def _same_sequence(a: Run, b: Run) -> bool:
    """Whether two runs (of different sizes) ran the same ops, segment by segment, up to
    layout ops (see ``_align``)."""
    if a.ops == b.ops:
        return True
    segs_a, segs_b = a.segments(), b.segments()
    if [k for k, _ in segs_a] != [k for k, _ in segs_b]:
        return False
    return all(
        _align(ops_a, values_b, ops_b) is not None
        for (_, (_, ops_a)), (_, (values_b, ops_b)) in zip(segs_a, segs_b, strict=True)
    )


def _consistent_runs(runs: list[SizeRuns], warnings: list[str]) -> list[SizeRuns]:
    """The runs of the sizes that ran the same op sequence as most others, when one or more
    sizes ran a different one and at least two remain. ``nn.TransformerEncoderLayer``, for
    one, takes another path at micro-batch 1: that size tells nothing about the others, and
    fitting segment maxima instead of points would under-predict. A sequence that differs at
    every size (data-dependent routing) is left to ``_timeline``'s fallback."""
    if len(runs) < 3:
        return runs

    def same(a: SizeRuns, b: SizeRuns) -> bool:
        return all(
            _same_sequence(getattr(a, phase), getattr(b, phase))
            for phase in (
                "no_grads",
                "grads_resident",
                "ckpt_no_grads",
                "ckpt_grads_resident",
                *(("sel_no_grads", "sel_grads_resident") if a.sel_no_grads else ()),
            )
        )

    groups: list[list[SizeRuns]] = []
    for r in reversed(runs):  # larger sizes first: on a tie, the larger sizes win
        for group in groups:
            if same(group[0], r):
                group.append(r)
                break
        else:
            groups.append([r])
    best = max(groups, key=len)
    if len(groups) == 1 or len(best) < 2:
        return runs
    kept = sorted(best, key=lambda r: r.size)
    dropped = [r.size for r in runs if r not in kept]
    warnings.append(
        f"Micro-batch {', '.join(map(str, dropped))} ran a different op sequence from "
        f"{', '.join(str(r.size) for r in kept)} (a path taken only at that size); it was left "
        "out of the fits."
    )
    return kept


def _late_difference(plain: list[tuple[int, bool]], ckpt: list[tuple[int, bool]], sign: int) -> int:
    """Bytes of the storages (matched by position) alive at the end of the forward in one
    run and not the other: ``sign`` 1 counts those only the plain run keeps, -1 those only
    the checkpointed run keeps."""
    if len(plain) != len(ckpt):
        return 0
    total = 0
    for (nbytes, alive_plain), (_, alive_ckpt) in zip(plain, ckpt, strict=True):
        if sign > 0 and alive_plain and not alive_ckpt:
            total += nbytes
        elif sign < 0 and alive_ckpt and not alive_plain:
            total -= nbytes
    return total


def _savings(r: SizeRuns, j: int, mode_run: str = "ckpt_no_grads") -> int:
    """What checkpointing layer j frees while it is held, measured: what its forward keeps
    beyond its inputs (plain minus checkpointed, at its forward's end), plus its outputs
    when, by the end of the forward, only the plain run still keeps them (a consumer that
    saves nothing, like interpolate or cat, lets the checkpointed outputs go once it ran),
    minus its inputs when only the checkpoint keeps them (an input that needs no gradient,
    from a frozen embedding, is kept by nothing else)."""
    plain, ckpt = r.no_grads.record, getattr(r, mode_run).record
    assert plain is not None and ckpt is not None
    x, y = plain.layers[j], ckpt.layers[j]
    own = (x.post_live - x.pre_live) - (y.post_live - y.pre_live)
    outputs = _late_difference(x.outputs_late, y.outputs_late, 1)
    inputs = _late_difference(x.inputs_late, y.inputs_late, -1)
    return own + outputs + inputs


def assemble(
    session: Session,
    runs: list[SizeRuns],
    extra: dict[str, Any],
    extra_timed: TimedSize | None = None,
) -> Profile:
    warnings = list(session.warnings)
    probed = tuple(r.size for r in runs)
    runs = _consistent_runs(runs, warnings)
    sizes = [r.size for r in runs]
    timed = [
        TimedSize(r.size, r.timing, r.optimizer_seconds, r.ckpt_timing, r.sel_timing) for r in runs
    ]
    if extra_timed is not None:
        timed.append(extra_timed)
    time_sizes = [t.size for t in timed]
    grads, state = runs[-1].grads, runs[-1].state
    modules = dict(session.model.named_modules())
    n_layers = len(session.layer_names)

    def layer_series(attr: Callable[[SizeRuns, int], float], j: int) -> Affine:
        return _fit(sizes, [attr(r, j) for r in runs])

    def layer_seconds(attr: Callable[[TimedSize, int], float], j: int) -> Affine:
        return _fit_time(time_sizes, [attr(t, j) for t in timed])

    def rec(run: Run, j: int) -> Any:
        assert run.record is not None
        return run.record.layers[j]

    def saved(run: Run, j: int) -> int:
        return rec(run, j).post_live - rec(run, j).pre_live

    savings = [layer_series(_savings, j) for j in range(n_layers)]
    has_sel = all(r.sel_no_grads is not None for r in runs)
    sel_savings = (
        [layer_series(lambda r, j: _savings(r, j, "sel_no_grads"), j) for j in range(n_layers)]
        if has_sel
        else None
    )
    sel_timed = all(t.sel_timing is not None for t in timed)

    layers = []
    for j, name in enumerate(session.layer_names):
        module = modules[name]
        params = _unique_params(module)
        trainable, frozen = param_bytes(module)

        def fwd_transient(r: SizeRuns, j: int) -> int:
            x = rec(r.no_grads, j)
            return _window_peak(r.no_grads.values, x.pre_pos, x.post_pos, x.pre_live)

        def bwd_transient(r: SizeRuns, j: int, ckpt: bool = False) -> int:
            run = r.ckpt_no_grads if ckpt else r.no_grads
            x = rec(run, j)
            return (
                _window_peak(run.values, x.bwd_pos0, x.bwd_pos1, x.bwd_live0)
                if x.bwd_pos0 >= 0
                else 0
            )

        byte_fits = {
            "input_bytes": layer_series(lambda r, j: rec(r.no_grads, j).input_bytes, j),
            "output_bytes": layer_series(lambda r, j: rec(r.no_grads, j).output_bytes, j),
            "saved_bytes": layer_series(lambda r, j: saved(r.no_grads, j), j),
            "savings_bytes": savings[j],
            "fwd_transient_bytes": layer_series(fwd_transient, j),
            "bwd_transient_bytes": layer_series(bwd_transient, j),
            "recompute_transient_bytes": layer_series(lambda r, j: bwd_transient(r, j, True), j),
        }
        is_affine = all(f.residual <= AFFINE_TOLERANCE for f in byte_fits.values())
        if not is_affine:
            worst = max(byte_fits, key=lambda k: byte_fits[k].residual)
            warnings.append(
                f"layer {name}: {worst} is not affine in the micro-batch "
                f"(residual {byte_fits[worst].residual:.1%}); do not trust "
                "extrapolation from it."
            )
        layers.append(
            Layer(
                name=name,
                module_type=type(module).__name__,
                params_trainable_bytes=trainable,
                params_frozen_bytes=frozen,
                grad_bytes=sum(grads.get(id(p), 0) for p in params),
                optimizer_state_bytes=sum(state.get(id(p), 0) for p in params),
                **byte_fits,
                fwd_seconds=layer_seconds(
                    lambda r, j: r.timing.layers[j].fwd_t1 - r.timing.layers[j].fwd_t0, j
                ),
                bwd_seconds=layer_seconds(
                    lambda r, j: _bwd_seconds(r.timing.layers[j].bwd_t0, r.timing.layers[j].bwd_t1),
                    j,
                ),
                fwd_flops=layer_series(lambda r, j: rec(r.no_grads, j).flops, j),
                recompute_seconds=None
                if any(t.ckpt_timing is None for t in timed)
                else layer_seconds(
                    lambda t, j: _layer_seconds(t.ckpt_timing, j) - _layer_seconds(t.timing, j), j
                ),
                selective_savings_bytes=sel_savings[j] if sel_savings else None,
                selective_recompute_seconds=layer_seconds(
                    lambda t, j: _layer_seconds(t.sel_timing, j) - _layer_seconds(t.timing, j), j
                )
                if sel_savings and sel_timed
                else None,
                affine=is_affine,
                has_batchnorm=has_batchnorm(module),
            )
        )

    # Fixed parts, in the order they first ran; then parameters held directly by ancestors
    # of the layers, then the loss computed outside the model's forward.
    first = runs[0].no_grads.record
    assert first is not None
    ran = sorted(first.parts, key=lambda n: first.parts[n].first_seen)
    fixed = []
    for name in ran:
        module = modules[name]
        params = _unique_params(module)
        trainable, frozen = param_bytes(module)

        def part(r: Any, name: str = name) -> Any:
            return r.record.parts[name] if hasattr(r, "record") else r.parts[name]

        fixed.append(
            FixedPart(
                name=name,
                module_type=type(module).__name__,
                params_trainable_bytes=trainable,
                params_frozen_bytes=frozen,
                grad_bytes=sum(grads.get(id(p), 0) for p in params),
                optimizer_state_bytes=sum(state.get(id(p), 0) for p in params),
                saved_bytes=_fit(sizes, [part(r.no_grads).saved_bytes for r in runs]),
                fwd_seconds=_fit_time(time_sizes, [part(t.timing).fwd_seconds for t in timed]),
                bwd_seconds=_fit_time(
                    time_sizes,
                    [_bwd_seconds(part(t.timing).bwd_t0, part(t.timing).bwd_t1) for t in timed],
                ),
                fwd_flops=_fit(sizes, [part(r.no_grads).flops for r in runs]),
            )
        )
    for owner in own_params_owners(session.model, session.layer_names):
        module = modules[owner]
        params = _unique_params(module, recurse=False)
        trainable, frozen = param_bytes(module, recurse=False)
        fixed.append(
            FixedPart(
                name=f"{owner or '(root)'} (own parameters)",
                module_type=type(module).__name__,
                params_trainable_bytes=trainable,
                params_frozen_bytes=frozen,
                grad_bytes=sum(grads.get(id(p), 0) for p in params),
                optimizer_state_bytes=sum(state.get(id(p), 0) for p in params),
                saved_bytes=Affine.zero(),
                fwd_seconds=Affine.zero(),
                bwd_seconds=Affine.zero(),
                fwd_flops=Affine.zero(),
            )
        )
    loss_saved = [r.no_grads.record.loss_saved_bytes for r in runs]  # type: ignore[union-attr]
    loss_flops = [r.no_grads.record.loss_flops for r in runs]  # type: ignore[union-attr]
    if any(loss_saved) or any(loss_flops):
        fixed.append(
            FixedPart(
                name="(loss)",
                module_type="training_loss",
                params_trainable_bytes=0,
                params_frozen_bytes=0,
                grad_bytes=0,
                optimizer_state_bytes=0,
                saved_bytes=_fit(sizes, loss_saved),
                fwd_seconds=_fit_time(time_sizes, [t.timing.loss_seconds for t in timed]),
                bwd_seconds=Affine.zero(),
                fwd_flops=_fit(sizes, loss_flops),
            )
        )

    timeline = {}
    stable = True
    for phase in ("no_grads", "grads_resident"):
        segs, ok = _timeline(
            sizes,
            [getattr(r, phase) for r in runs],
            [getattr(r, f"ckpt_{phase}") for r in runs],
            savings,
            warnings,
            [getattr(r, f"sel_{phase}") for r in runs] if has_sel else None,
            sel_savings,
        )
        timeline[phase] = segs
        stable &= ok
    if not stable:
        warnings.append(
            "The op sequence differed between probed sizes (data-dependent "
            "routing?): segment maxima were fitted, not points; verify plans at "
            "their micro-batch."
        )

    def step_fixed(r: TimedSize) -> float:
        t = r.timing
        in_layers = sum(x.fwd_t1 - x.fwd_t0 + _bwd_seconds(x.bwd_t0, x.bwd_t1) for x in t.layers)
        return (t.t_end - t.t_start) - in_layers

    model = session.model
    params_trainable, params_frozen = param_bytes(model)
    buffers = storages_bytes(model.buffers())
    first_param = next(model.parameters())
    backend = session.backend
    bn = has_batchnorm(model)
    if bn:
        warnings.append(
            "The model has BatchNorm: its statistics come from the micro-batch, "
            "not the effective batch, and update twice under checkpoint recompute."
        )
    return Profile(
        model=ModelRef(
            path=session.model_file.reference or str(session.model_file.path),
            factory=session.model_file.factory,
            sha256=session.model_file.sha256,
        ),
        environment=Environment(
            torch_version=str(torch.__version__),
            memplan_version=memplan.__version__,
            device=backend.device,  # type: ignore[arg-type]
            device_name=backend.device_name(),
            device_capacity_bytes=backend.capacity_bytes(),
            device_profile=backend.spec.name if backend.spec else None,
            precision=backend.precision,  # type: ignore[arg-type]
            optimizer_class=type(session.optimizer).__name__,
            param_dtype=str(first_param.dtype).removeprefix("torch."),
            mixed_precision=backend.mixed_precision,  # type: ignore[arg-type]
        ),
        micro_batches=probed,
        totals=Totals(
            params_trainable_bytes=params_trainable,
            params_frozen_bytes=params_frozen,
            buffer_bytes=buffers,
            grad_bytes=sum(grads.values()),
            optimizer_state_bytes=storages_bytes(
                t for s in session.optimizer.state.values() for t in state_tensors(s)
            ),
        ),
        layers=tuple(layers),
        fixed=tuple(fixed),
        timeline=timeline,
        optimizer_step_peak_bytes=_fit(sizes, [r.optimizer.peak_bytes for r in runs]),
        optimizer_step_seconds=_fit_time(time_sizes, [t.optimizer_seconds for t in timed]),
        step_fixed_seconds=_fit_time(time_sizes, [step_fixed(t) for t in timed]),
        allocator_reserve_bytes=extra.get("allocator_reserve_bytes"),
        context_bytes=extra.get("context_bytes"),
        has_batchnorm=bn,
        op_sequence_stable=stable,
        warnings=tuple(dict.fromkeys(warnings)),
    )


# ------------------------------------------------------------------------------ entry
def probe_model(
    model_file_path: str,
    *,
    device: str = "auto",
    micro_batches: Sequence[int] = (1, 2, 4),
    precision: str = "fp32",
    layers: str | None = None,
    device_profile: str | None = None,
    on_progress: Progress | None = None,
    mixed_precision: str = "autocast",
    reuse_identical: bool = True,
) -> Profile:
    """Measure ``model_file_path`` per layer and return its Profile (see profile.py). On
    meta, identical blocks reuse their representative's meta results unless
    ``reuse_identical`` is False (memplan.probe.dedup)."""
    sizes = sorted(set(int(b) for b in micro_batches))
    if len(sizes) < 2 or sizes[0] < 1:
        raise BadInputError(
            f"micro_batches {tuple(micro_batches)} must hold at least two distinct positive sizes.",
            hint="For example 1,2,4: affine fits need two sizes; three give a residual.",
        )
    total = (
        2 + (6 + (device != "meta")) * len(sizes) + 1 + (device != "meta")
    )  # + the timing-only size
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, total, what)

    model_file = load_model_file(model_file_path)
    try:
        return _probe(
            model_file,
            sizes,
            device,
            precision,
            layers,
            device_profile,
            tick,
            mixed_precision,
            reuse_identical,
        )
    except Exception as exc:
        known = checkpointing_failure(exc, model_file.spec)
        if known is None:
            raise
        raise known from exc


def _probe(
    model_file: ModelFile,
    sizes: list[int],
    device: str,
    precision: str,
    layers: str | None,
    device_profile: str | None,
    tick: Callable[[str], None],
    mixed_precision: str,
    reuse_identical: bool,
) -> Profile:
    backend = make_backend(device, precision, device_profile, mixed_precision, reuse_identical)
    session = open_session(model_file, backend, layers)
    if not session.layer_names:
        session.warnings.append(
            "No repeated blocks (an nn.ModuleList/nn.Sequential of "
            "same-type modules) found: no checkpoint candidates. Name "
            "some with --layers GLOB."
        )
    tick("built the model")
    cuda = backend.device == "cuda"
    forward_misses = (
        None
        if backend.op_cache is None
        else ForwardMisses(backend.op_cache, session.layers, session.layer_names)
    )
    refuse_unfit_first_size(session, sizes[0])
    try:
        warm_up(session, sizes[0])
    except torch.OutOfMemoryError as exc:
        raise CannotMeasureError(
            f"Out of GPU memory at the smallest micro-batch ({sizes[0]}) during the warm-up step.",
            hint="The model does not train on this GPU even at that size; try --device meta "
            "with a larger GPU spec.",
        ) from exc
    tick("warm-up step")
    runs: list[SizeRuns] = []
    extra: dict[str, Any] = {}
    for size in sizes:
        if runs:
            refuse_unfit_size(session, runs[0], size)
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            runs.append(run_size(session, size, tick))
        except torch.OutOfMemoryError as exc:
            session.zero_grad()
            gc.collect()
            torch.cuda.empty_cache()
            fitted = [r.size for r in runs]
            if len(fitted) < 2:
                raise CannotMeasureError(
                    f"Out of GPU memory at micro-batch {size}; sizes that fit: "
                    f"{fitted or 'none'} (two are needed for a fit).",
                    hint="Probe smaller sizes with --micro-batches, or use --device meta.",
                ) from exc
            session.warnings.append(
                f"Out of GPU memory at micro-batch {size}: probed {fitted} only."
            )
            break
        if cuda:
            allocated = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
            extra["allocator_reserve_bytes"] = reserved - allocated
            info = local_gpu(torch.cuda.current_device())
            if info is not None and info.process_used_bytes is not None:
                extra["context_bytes"] = max(
                    0, info.process_used_bytes - torch.cuda.memory_reserved()
                )
            r = runs[-1]
            tracked = max(
                r.no_grads.peak_bytes,
                r.grads_resident.peak_bytes,
                r.ckpt_no_grads.peak_bytes,
                r.ckpt_grads_resident.peak_bytes,
                r.optimizer.peak_bytes,
                *(run.peak_bytes for run in (r.sel_no_grads, r.sel_grads_resident) if run),
            )
            if allocated and abs(allocated - tracked) > 0.05 * allocated:
                session.warnings.append(
                    f"At micro-batch {size} the tracker saw a peak of {tracked} B but "
                    f"torch.cuda.max_memory_allocated says {allocated} B (>5% apart)."
                )
    extra_timed = None
    if (
        session.backend.device != "meta"
        and len(runs) == len(sizes)
        and estimated_bytes(session, runs[0], TIMING_EXTRA_FACTOR * sizes[-1])[0]
        <= (available_bytes(session.backend.device) or math.inf)
    ):
        extra_timed = time_extra_size(session, TIMING_EXTRA_FACTOR * sizes[-1])
        tick(f"b={TIMING_EXTRA_FACTOR * sizes[-1]}: timing only")
    profile = assemble(session, runs, extra, extra_timed)
    if forward_misses is not None:
        forward_misses.remove()
        profile = dataclasses.replace(
            profile, deduplicated_layers=forward_misses.reusing(session.layer_names)
        )
    session.recorder.remove()
    tick("fitted the timeline")
    return profile
