"""Running one probed micro-batch size: the tracked phases (plain, all-checkpointed, all-
selective), the untracked timed runs, and the refusal of a size the device cannot hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memplan.devices import local_gpu
from memplan.errors import (
    BadInputError,
    CannotMeasureError,
    InternalError,
    MemplanError,
    checkpointing_failure,
    first_line,
    raised_by_checkpointing,
)
from memplan.model.batch import batch_tensors
from memplan.modes import SELECTIVE
from memplan.probe.alignment import grad_and_state_bytes, layer_seconds
from memplan.probe.recorder import StepRecord
from memplan.probe.session import Run, Session, SizeRuns
from memplan.profile import NOT_CHECKPOINTABLE
from memplan.run.checkpoint import checkpointed, in_mode
from memplan.units import format_bytes


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


@dataclass(slots=True)
class TimedSize:
    """Untracked times at one size: a plain micro-step, what full and selective
    checkpointing of each layer add to a micro-step (measured), and an optimizer step."""

    size: int
    timing: StepRecord
    optimizer_seconds: float
    full_seconds: tuple[float, ...] | None
    """Per layer: extra seconds per micro-step with the layer fully checkpointed."""
    selective_seconds: tuple[float, ...] | None = None
    """Per layer: the same under selective checkpointing (on meta, from the tracked runs'
    virtual clocks: :func:`run_size`)."""


def _total_seconds(record: StepRecord) -> float:
    return record.t_end - record.t_start


def mode_seconds(plain: Sequence[StepRecord], moded: Sequence[StepRecord]) -> tuple[float, ...]:
    """Per layer: what running every layer in a mode adds to a micro-step, from rounds that
    each ran a plain micro-step and the mode's one back to back (``plain[r]``, ``moded[r]``).

    All of the cost counts: a layer's forward (selective checkpointing sends every op of it
    through a Python dispatch mode, and full checkpointing packs its inputs) and its
    backward (the recompute, and the saved tensors unpacked), measured between the layer's
    hooks, plus an even share of any change outside the layers (the autograd engine's own
    work on the checkpoint's nodes). A median of the round-by-round differences, so a slow
    spell of a shared machine, which hits one round, moves no decision."""
    n = len(plain[0].layers) if plain else 0
    if n == 0:
        return ()
    pairs = list(zip(plain, moded, strict=True))
    per_layer = [
        statistics.median(layer_seconds(m, j) - layer_seconds(p, j) for p, m in pairs)
        for j in range(n)
    ]

    def outside(record: StepRecord) -> float:
        return _total_seconds(record) - sum(layer_seconds(record, j) for j in range(n))

    rest = statistics.median(outside(m) - outside(p) for p, m in pairs)
    return tuple(c + rest / n for c in per_layer)


def rounds_phrase(rounds: int) -> str:
    """``1 round``, ``5 rounds``: how a progress label names the timing rounds."""
    return f"{rounds} round{'' if rounds == 1 else 's'}"


def time_size(
    session: Session, batch: Any
) -> tuple[StepRecord, float, tuple[float, ...], tuple[float, ...] | None]:
    """Untracked, so the tracker's overhead stays out of the times: the backend's
    ``timing_rounds`` rounds (``probe --timing-rounds``, 5 unless given),
    each a plain, an all-checkpointed and (not on meta) an all-selective micro-step back to
    back, then the optimizer steps. Interleaved, so a slow spell of the machine hits one
    round of every configuration alike rather than all repeats of one. Returns the plain
    record of the round with the median plain total (per-layer times of one consistent
    run), the optimizer step's median, and per layer what full and selective (None on
    meta) add (:func:`mode_seconds`)."""
    layers = session.layers
    configs: list[tuple[str, Callable[[], Any]]] = [
        ("plain", contextlib.nullcontext),
        ("full", lambda: checkpointed(layers, context_fn=session.backend.checkpoint_context_fn())),
    ]
    if session.selective_runs:
        configs.append((SELECTIVE, lambda: selective_step(session)))
    records: dict[str, list[StepRecord]] = {name: [] for name, _ in configs}
    rounds = session.backend.timing_rounds
    for _ in range(rounds):
        for name, context in configs:
            with context():
                session.zero_grad()
                records[name].append(session.micro_step(batch, None))
    plain = sorted(records["plain"], key=_total_seconds)[len(records["plain"]) // 2]
    optimizer_seconds = statistics.median(session.timed_optimizer_step() for _ in range(rounds))
    session.zero_grad()
    selective = records.get(SELECTIVE)
    return (
        plain,
        optimizer_seconds,
        mode_seconds(records["plain"], records["full"]),
        mode_seconds(records["plain"], selective) if selective else None,
    )


def time_extra_size(session: Session, size: int) -> TimedSize | None:
    """Times only (no tracking) at a size above the probed ones. At the small sizes a probe
    uses, a layer's time is mostly fixed overhead and its growth per sample is lost in
    noise; one larger size makes the per-sample slope a measurement, not an extrapolation.
    Skipped (None) when it does not fit the device."""
    try:
        batch = session.backend.batch(session.model_file, size)
        timing, optimizer_seconds, full, selective = time_size(session, batch)
    except torch.OutOfMemoryError:
        session.zero_grad()
        gc.collect()
        torch.cuda.empty_cache()
        return None
    return TimedSize(size, timing, optimizer_seconds, full, selective)


def available_bytes(device: str) -> int | None:
    """What a micro-step may still allocate: free GPU memory on cuda, the host's available
    memory on cpu and meta (meta allocates nothing but the batch, which is on the host)."""
    from memplan.devices import host_available_bytes

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


def _recompute_failure(
    session: Session, layers: list[torch.nn.Module], batch: Any
) -> Exception | None:
    """One micro-step with ``layers`` fully checkpointed: None when it runs, else what the
    recompute raised. Only errors checkpointing raised count (memplan's own InternalError
    and running out of memory never do); any other error is the probe's to report."""
    session.zero_grad()
    try:
        context_fn = session.backend.checkpoint_context_fn()
        with checkpointed(layers, context_fn=context_fn), session.backend.guard():
            session.micro_step(batch, None)
    except Exception as exc:
        if _is_oom(exc) or isinstance(exc, InternalError) or not raised_by_checkpointing(exc):
            raise  # out of memory in a recompute is the device's limit, not the layer's
        return exc
    finally:
        session.zero_grad()
    return None


def drop_uncheckpointable(session: Session, size: int, tick: Callable[[str], None]) -> None:
    """Leave out of the candidates every layer whose recompute does not match its forward,
    before any measured run. The warm-up step ran the model plain at ``size``; one more
    with every candidate fully checkpointed shows whether checkpointing changes what runs.
    When it fails, each candidate is tried alone: a layer whose recompute fails by itself
    (a key/value cache its forward fills and its recompute fills again: transformers'
    XLM; a counter) is left out with a warning and counted as a fixed part, so no plan
    checkpoints it; the other candidates keep their figures. A failure that no single
    layer shows is the probe's to report (CheckpointingError, exit 3)."""
    tick("checkpointing trial")
    if not session.layers:
        return
    batch = session.backend.batch(session.model_file, size)
    together = _recompute_failure(session, session.layers, batch)
    if together is None:
        return
    failures = {
        name: exc
        for name, layer in zip(session.layer_names, session.layers, strict=True)
        if (exc := _recompute_failure(session, [layer], batch)) is not None
    }
    if not failures:  # only together: the callers of probe_sizes make it CheckpointingError
        raise together
    first = next(iter(failures.values()))
    if isinstance(first, MemplanError) and isinstance(first.__cause__, Exception):
        first = first.__cause__  # the meta probe's refusal of the op: what the op raised
    shown = ", ".join(list(failures)[:4]) + (", …" if len(failures) > 4 else "")
    session.warnings.append(
        f"{len(failures)} of {len(session.layer_names)} candidate layer(s) "
        f"{NOT_CHECKPOINTABLE}, their recompute in the backward not matching their forward "
        f"({shown}: "
        f"{type(first).__name__}: {first_line(first, type(first).__name__)[:200]}): state the "
        "forward changes, such as a key/value cache, or randomness torch does not replay. "
        "They are left out of the candidates and counted as fixed parts, so no plan "
        "checkpoints them"
    )
    session.rehook([name for name in session.layer_names if name not in failures])


def selective_mode(session: Session) -> Any:
    """Every candidate layer under selective checkpointing, its recompute (on meta) under
    the backend's autocast and attention kernels as the forward is."""
    return in_mode(session.layers, SELECTIVE, context_fn=session.backend.checkpoint_context_fn())


class SelectiveFailed(Exception):
    """A micro-step under selective checkpointing failed in its recompute after
    ``try_selective``'s step ran: a path the batch chooses (an LSTM over sequences packed
    with ``enforce_sorted=False`` reorders a batch of 2, not one of 1, in place of what the
    policy saved). Raised out of a size's runs, so the probe drops selective for the whole
    profile (``selective_off``) and runs the size again."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


@contextlib.contextmanager
def selective_step(session: Session) -> Iterator[None]:
    """``selective_mode`` for a measured run: a checkpointing failure in it becomes
    ``SelectiveFailed``; any other error is the probe's to report."""
    try:
        with selective_mode(session):
            yield
    except Exception as exc:
        if checkpointing_failure(exc, session.model_file.spec) is None:
            raise
        raise SelectiveFailed(exc) from exc


def selective_off(session: Session, exc: Exception, size: int) -> None:
    """No selective figures for this profile, and a warning that says why."""
    first = first_line(exc, type(exc).__name__)[:200]
    session.selective_runs = False
    session.zero_grad()
    session.warnings.append(
        f"selective checkpointing does not run on this model at micro-batch {size} "
        f"({type(exc).__name__}: {first}): the profile has no selective figures, so plans "
        "use keep and full only"
    )


def without_selective(runs: SizeRuns) -> SizeRuns:
    """``runs`` with its selective figures dropped (``selective_off`` came after it ran)."""
    return dataclasses.replace(
        runs, sel_no_grads=None, sel_grads_resident=None, selective_seconds=None
    )


def try_selective(session: Session, size: int) -> None:
    """One micro-step with every layer under selective checkpointing, before any measured
    run. A model whose recompute under the selective policy fails (torch's check that a
    tensor the policy saved was not changed in place afterwards, ConvBERT's in-place ops
    on a matmul's output) gets no selective figures, with a warning, rather than no
    profile: keep and full still run. Any other error is the probe's to report. A failure
    only a later size shows is ``SelectiveFailed`` there."""
    batch = session.backend.batch(session.model_file, size)
    session.zero_grad()
    try:
        with selective_step(session), session.backend.guard():
            session.micro_step(batch, None)
    except SelectiveFailed as failed:
        selective_off(session, failed.cause, size)
    finally:
        session.zero_grad()


def _modules_run(session: Session, run: Run) -> set[str]:
    """The candidate layers and fixed parts whose forward ``run`` saw."""
    record = run.record
    assert record is not None
    return {session.layer_names[i] for i in record.layer_order} | set(record.parts)


def refuse_random_layers(session: Session, size: int, first: Run, second: Run, what: str) -> None:
    """Raise when two micro-steps of the same batch on the same weights (no optimizer step
    between them) ran different modules: layers skipped at random in training (LayerDrop
    that memplan.run.disable_layerdrop did not find, a hand-written stochastic depth that
    skips whole blocks). No profile fits a step whose layers are drawn: each probed size
    would hold other layers, and the fits read as corrupted (negative bytes per sample)."""
    one, two = _modules_run(session, first), _modules_run(session, second)
    if one == two:
        return
    differ = sorted(one ^ two)
    shown = ", ".join(differ[:4]) + (", …" if len(differ) > 4 else "")
    raise CannotMeasureError(
        f"{session.model_file.spec}: two {what} micro-steps of the same batch of {size} on "
        f"the same weights ran different modules ({shown} ran in one and not the other): "
        "the model skips layers at random in training (LayerDrop, or a stochastic depth "
        "that skips whole blocks), so no profile describes its step",
        hint="Switch the random skipping off in build_model (for Hugging Face models "
        "memplan does this itself for attributes named *layerdrop*): the step that runs "
        "every layer is the most any draw needs, so its plan is an upper bound with it on.",
    )


def run_size(session: Session, size: int, tick: Callable[[str], None]) -> SizeRuns:
    backend, mf = session.backend, session.model_file
    batch = backend.batch(mf, size)
    session.zero_grad()
    tick(f"b={size}: no_grads")
    no_grads = session.tracked_step(batch)
    tick(f"b={size}: grads_resident")
    grads_resident = session.tracked_step(batch)
    refuse_random_layers(session, size, no_grads, grads_resident, "plain")
    tick(f"b={size}: optimizer step")
    optimizer = session.tracked_optimizer_step(batch)
    grads, state = grad_and_state_bytes(session.model, session.optimizer)
    session.zero_grad()
    full_seconds = selective_seconds = None
    if backend.device == "meta":
        tick(f"b={size}: timing (meta clock)")
        timing, optimizer_seconds = no_grads.record, optimizer.virtual_seconds
    else:
        tick(f"b={size}: timing ({rounds_phrase(backend.timing_rounds)})")
        timing, optimizer_seconds, full_seconds, selective_seconds = time_size(session, batch)
    with checkpointed(session.layers, context_fn=backend.checkpoint_context_fn()):
        tick(f"b={size}: checkpointed no_grads")
        ckpt_no_grads = session.tracked_step(batch)
        tick(f"b={size}: checkpointed grads_resident")
        ckpt_grads_resident = session.tracked_step(batch)
        refuse_random_layers(session, size, ckpt_no_grads, ckpt_grads_resident, "checkpointed")
    session.zero_grad()
    sel_no_grads = sel_grads_resident = None
    if session.selective_runs:
        tick(f"b={size}: selective")
        with selective_step(session):
            sel_no_grads = session.tracked_step(batch)
            sel_grads_resident = session.tracked_step(batch)
        refuse_random_layers(session, size, sel_no_grads, sel_grads_resident, "selective")
        session.zero_grad()
        if backend.device == "meta":  # the roofline of the ops the recompute re-runs
            selective_seconds = mode_seconds([no_grads.record], [sel_no_grads.record])
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
        full_seconds,
        sum(t.numel() * t.element_size() for t in batch_tensors(batch)),
        sel_no_grads,
        sel_grads_resident,
        selective_seconds,
    )
