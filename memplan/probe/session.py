"""A probe session: the model, optimizer, recorder and backend of one probe, the runs it records
per micro-batch size, and the warm-up step.

The model's backward (``run_backward``, ``users_backward``) runs code the model file wrote
or built: a custom ``torch.autograd.Function``'s ``backward``, its hooks, autograd's checks
of the graph its forward made (a tensor saved for the backward, then changed in place). An
error there is the model file's, exit 2, as one in its forward is (``ModelFile._call``,
``ModelFile.loss``): a ``ModelFileError`` at the user's ``file:line`` where the traceback
has one, else naming the file (and, for autograd's in-place check, the op). memplan's own
failures stay its own: its errors raised by its own frames pass unchanged (the tracker's
``InternalError``, exit 3), so do activation checkpointing's (the probe and verify make
them ``CheckpointingError``) and running out of device memory; an exception that no user
frame raised and a memplan frame did is memplan's (``InternalError``, exit 3).
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memplan.errors import (
    CannotMeasureError,
    Interrupted,
    MemplanError,
    ModelFileError,
    first_line,
    internal_failure,
    raised_by_checkpointing,
)
from memplan.model.batch import batch_tensors
from memplan.model.loader import (
    ModelFile,
    entering,
    memplans_file,
    raised_by_memplan,
    users_file,
)
from memplan.probe.backends import Backend
from memplan.probe.layers import default_candidates, fixed_parts, glob_layers
from memplan.probe.meta_kernels import refuse_mixed_dtypes
from memplan.probe.nonfinite import where_nonfinite
from memplan.probe.recorder import Recorder, StepRecord
from memplan.probe.roofline import ClockKey
from memplan.probe.tracker import LiveTracker, kept_tensors, resident_tensors
from memplan.profile import LOSS_NOT_FINITE
from memplan.run.training_state import (
    disable_hf_checkpointing,
    disable_kv_cache,
    disable_layerdrop,
    hf_checkpointing_note,
    kv_cache_note,
    layerdrop_note,
)

_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")

Series = tuple[list[int], list[str]]


@dataclass(slots=True)
class Run:
    """One tracked micro-step (or optimizer step)."""

    record: StepRecord | None
    values: list[int]
    peak_bytes: int
    virtual_seconds: float = 0.0
    ops: list[str] = field(default_factory=list)
    clock_mix: dict[ClockKey, float] = field(default_factory=dict)
    """The meta clock's seconds by what bounded them (``LiveTracker.clock_mix``)."""

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
    full_seconds: tuple[float, ...] | None = None
    """Per layer: what full checkpointing adds to a micro-step, measured untracked
    (memplan.probe.sizes.mode_seconds; None on meta: no real times)."""
    batch_bytes: int = 0
    """Bytes of the batch's tensors (made on the host by ``make_batch``)."""
    sel_no_grads: Run | None = None
    sel_grads_resident: Run | None = None
    """Both phases with every layer under selective checkpointing (None when the model's
    recompute refuses the selective policy)."""
    selective_seconds: tuple[float, ...] | None = None
    """Per layer: what selective checkpointing adds to a micro-step (on meta, the virtual
    clock's: the roofline of the ops its recompute re-runs)."""


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
    kept_at_start: tuple[torch.Tensor, ...] = ()
    """``kept_tensors()`` before the first step: none of them is a cache a step fills."""
    selective_runs: bool = True
    """Whether the all-selective runs happen: not on a model whose recompute under the
    selective policy fails (:func:`memplan.probe.sizes.try_selective`)."""
    forward_grads: tuple[str, ...] = ()
    """Parameters (by name) whose gradient a micro-step's forward made: the loss ran a
    backward of its own (``memplan.run.losses.chunked_cross_entropy``); empty: none seen."""

    def kept_tensors(self) -> list[torch.Tensor]:
        """Tensors on the probe's device that the model's modules hold in plain attributes
        (a dict of rotary tables) or the model file holds in module-level variables."""
        roots: list[Any] = [
            {k: v for k, v in vars(m).items() if k not in _MODULE_SLOTS}
            for m in self.model.modules()
        ]
        user = self.model_file.module
        if user is not None:
            roots.append({k: v for k, v in vars(user).items() if not k.startswith("__")})
        device = self.backend.torch_device.type
        return [t for t in kept_tensors(roots) if t.device.type == device]

    def rehook(self, names: list[str]) -> None:
        """Make ``names`` the candidates (in that order): the recorder hooks them anew and
        every module left out becomes part of a fixed part."""
        modules = dict(self.model.named_modules())
        self.recorder.remove()
        self.layer_names = names
        self.layers = [modules[n] for n in names]
        self.part_names = fixed_parts(self.model, names)  # a dropped block is fixed
        self.recorder = Recorder(
            self.model,
            self.layers,
            {n: modules[n] for n in self.part_names},
            clock=self.backend.clock,
        )
        self.recorder.install()

    # ------------------------------------------------------------------------ stepping
    def micro_step(
        self, batch: Any, tracker: LiveTracker | None, *, scale: float = 1.0
    ) -> StepRecord:
        """Forward and backward of one micro-batch; the loss is dropped before returning."""
        recorder = self.recorder
        recorder.clock = lambda: self.backend.clock(tracker)
        no_grad = [(n, p) for n, p in self.model.named_parameters() if p.grad is None]
        recorder.begin(tracker)
        with self.backend.forward_context():
            loss = self.model_file.loss(self.model, batch)
            if scale != 1.0:
                loss = loss * scale
        recorder.forward_done()
        made = tuple(n for n, p in no_grad if p.grad is not None)
        if made and not self.forward_grads:
            self.forward_grads = made
        bad = None
        if loss.device.type != "meta":
            with _disable_current_modes():  # memplan's own check: no part of the step
                if not bool(torch.isfinite(loss.detach())):
                    bad = float(loss.detach())
        run_backward(self.model_file, loss)  # its errors: the model file's (exit 2)
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
            f"{LOSS_NOT_FINITE}{value} at {size} during the probe (a probe step of "
            f"{self.model_file.spec})"
        )
        tail = (
            f"; check {self.model_file.inputs_text()} for that size (e.g. statistics over "
            "a batch of one)."
        )
        first = not any(w.startswith(LOSS_NOT_FINITE) for w in self.warnings)
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
        tracker = self.backend.tracker(step=True)
        tracker.track(resident_tensors(self.model, self.optimizer, batch))
        with tracker:
            record = self.micro_step(batch, tracker)
        return Run(
            record,
            tracker.values,
            tracker.peak_bytes,
            tracker.virtual_seconds,
            tracker.ops,
            tracker.clock_mix(),
        )

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


def resolve_layers(model: torch.nn.Module, layers: str | None) -> tuple[list[str], str | None]:
    """The candidates, and a note when the defaults went a level deeper."""
    return (glob_layers(model, layers), None) if layers else default_candidates(model)


def open_session(
    model_file: ModelFile,
    backend: Backend,
    layers: str | None,
    build: Callable[[], torch.nn.Module] | None = None,
) -> Session:
    """``build`` makes the model instead of the backend (a copy of one whose run of
    identical blocks was cut short: memplan.probe.repeats)."""
    model = backend.build(model_file) if build is None else build()
    # The probe checkpoints every candidate; memplan.apply does the same for every plan.
    cache_note = kv_cache_note(disable_kv_cache(model))
    hf_note = hf_checkpointing_note(disable_hf_checkpointing(model))
    # LayerDrop draws the layers of each step: the probe measures the step with every layer.
    skipping_note = layerdrop_note(disable_layerdrop(model))
    optimizer = model_file.make_optimizer(model)
    names, deeper_note = resolve_layers(model, layers)
    modules = dict(model.named_modules())
    parts = fixed_parts(model, names)
    recorder = Recorder(
        model, [modules[n] for n in names], {n: modules[n] for n in parts}, clock=backend.clock
    )
    recorder.install()
    session = Session(
        model_file=model_file,
        backend=backend,
        model=model,
        optimizer=optimizer,
        layer_names=names,
        layers=[modules[n] for n in names],
        part_names=parts,
        recorder=recorder,
        warnings=[note for note in (cache_note, hf_note, skipping_note, deeper_note) if note],
    )
    session.kept_at_start = tuple(session.kept_tensors())
    return session


def warm_up(session: Session, size: int) -> None:
    """One full training step (so optimizer state exists); also finds the order in which
    the layers run, and re-hooks them in that order."""
    batch = session.backend.batch(session.model_file, size)
    session.zero_grad()
    with session.backend.guard():
        record = session.micro_step(batch, None)
        session.optimizer.step()
    session.zero_grad()
    shared = [i for i, layer in enumerate(record.layers) if layer.calls > 1]
    for i in shared:  # a block the model calls twice (ALBERT's shared layer): no candidate
        session.warnings.append(
            f"candidate layer {session.layer_names[i]} ran its forward "
            f"{record.layers[i].calls} times per micro-step (a shared block), and a candidate "
            "must run once: it is left out of the candidates and counted as a fixed part"
        )
    order = [i for i in record.layer_order if i not in shared]
    if len(order) != len(session.layer_names) or order != sorted(order):
        missing = [
            session.layer_names[i]
            for i in range(len(session.layer_names))
            if i not in order and i not in shared
        ]
        if missing:
            session.warnings.append(
                f"{len(missing)} candidate layer(s) never ran and are left out: "
                + ", ".join(missing[:5])
            )
        session.rehook([session.layer_names[i] for i in order])
    problems = [p for p in record.problems if "more than once" not in p]
    if problems:
        raise CannotMeasureError(
            f"{session.model_file.path}: {problems[0]}; a checkpoint candidate must run "
            "once per micro-step.",
            hint="Choose other layers with --layers GLOB.",
        )


# ------------------------------------------------------------------- the model's backward
_ENGINE = ("torch/autograd/graph.py", "torch/autograd/__init__.py")
"""Where torch's Python hands the backward to its engine: frames after these ran in it."""
_IN_PLACE = "modified by an inplace operation"
_IN_PLACE_PARTS = (
    re.compile(r"which is (output \d+ of \w+)"),  # the op that made it
    re.compile(r"^[^\[]*\[([\w.]+ \[[\d, ]*\])\]"),  # its type and shape
    re.compile(r"(is at version \d+; expected version \d+)"),
)
"""What autograd's in-place check says of the tensor, quoted in memplan's message."""


def run_backward(model_file: ModelFile, loss: Any) -> None:
    """``loss.backward()``, its errors reported as ``users_backward`` says (and, to
    ``observe_calls``, entered: ``check --timeout`` named a hang there the forward)."""
    entering("the model's backward")
    with users_backward(model_file):
        loss.backward()


@contextlib.contextmanager
def users_backward(model_file: ModelFile) -> Iterator[None]:
    """Around code that runs the model's backward (alone, or inside a training step whose
    forward errors ``ModelFile`` already reported): an error raised in autograd's engine
    becomes ``backward_error``'s; any other passes unchanged."""
    try:
        yield
    except BaseException as exc:
        known = backward_error(exc, model_file)
        if known is None:
            raise
        raise known from exc


def _passes(exc: BaseException) -> bool:
    """Errors the caller handles: an interrupt, memplan's own (raised by its frames), out
    of device memory, activation checkpointing's."""
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        return True
    if isinstance(exc, MemplanError | Interrupted) and raised_by_memplan(exc):
        return True
    return type(exc).__name__ == "OutOfMemoryError" or raised_by_checkpointing(exc)


def backward_error(exc: BaseException, model_file: ModelFile) -> MemplanError | None:
    """What memplan raises for ``exc``, raised in the model's backward: None where it is
    not from autograd's engine or passes unchanged (``_passes``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    engine = [i for i, f in enumerate(frames) if f.filename.replace("\\", "/").endswith(_ENGINE)]
    if not engine or _passes(exc):
        return None
    inside = frames[engine[0] + 1 :]  # what the backward ran (before: who called it)
    path = model_file.path
    described = f"{type(exc).__name__}: {first_line(exc)[:300]}".rstrip(": ")
    if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc):
        return CannotMeasureError(
            f"Out of host memory in the model's backward ({described}).",
            hint="The size asked for does not fit this machine: use a smaller micro-batch, "
            "or plan for this machine's memory.",
        )
    users = [f for f in inside if users_file(f.filename)]
    if not users and any("/torch/distributed/" in f.filename.replace("\\", "/") for f in inside):
        return None  # a collective's or FSDP's own failure on a rank: not the model's code
    ours = [f for f in inside if memplans_file(f.filename)]
    mixed = inside and inside[-1].name == refuse_mixed_dtypes.__name__  # the model's
    if not users and ours and ours[-1] is inside[-1] and not mixed:
        at = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}"
        return internal_failure(f"backward code ({at})", "the model's backward", exc)
    if users:
        frame = users[-1]
        same = Path(frame.filename).resolve() == path.resolve()
        home = path if same else Path(frame.filename)
        where = f"{home}:{frame.lineno}"
    else:
        home, where = path, str(path)
    if _IN_PLACE in str(exc):
        found = [m.group(1) for m in (r.search(str(exc)) for r in _IN_PLACE_PARTS) if m]
        said = f" ({', '.join(found)})" if found else ""
        return ModelFileError(
            f"{where}: the model's backward raised {type(exc).__name__}: a tensor saved for "
            f"the backward{said} was changed by an "
            "in-place operation in the forward after autograd saved it",
            hint=f"Replace that in-place op in {home} (h.mul_(s) → h = h * s, inplace=True → "
            "False); torch.autograd.set_detect_anomaly(True) around one training step of "
            "the model names the op's line.",
        )
    return ModelFileError(
        f"{where}: the model's backward raised {described}",
        hint=f"Fix the backward in {home} (a custom autograd Function's backward, a hook); "
        "memplan runs loss.backward() as a training script would.",
    )
