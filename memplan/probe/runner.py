"""Run the measured micro-steps and turn them into a ``memplan.profile.Profile``.

Per probed micro-batch size, after a warm-up step (so optimizer state exists): phase
``no_grads`` (gradients set to None), phase ``grads_resident`` (again, without zeroing), the
optimizer step; untracked rounds of a plain, an all-checkpointed and (not on meta) an
all-selective micro-step for times (memplan.probe.sizes.time_size: the tracker's own
overhead stays out of them); then both phases again with every candidate layer checkpointed,
and (not on meta) again with every layer under selective checkpointing (memplan.modes), so
that any mix of keep, selective and full is predicted exactly. Each point of each segment is
fitted across sizes (profile.py's module docstring says how the solver reads them).

This module runs the probe; memplan.probe.session holds its state, memplan.probe.sizes runs
one size, memplan.probe.alignment fits runs across sizes and memplan.probe.assemble builds
the Profile.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from memplan.devices import local_gpu
from memplan.errors import (
    BadInputError,
    CannotMeasureError,
    MemplanError,
    checkpointing_failure,
)
from memplan.model.loader import ModelFile, load_model_file
from memplan.probe.assemble import assemble
from memplan.probe.backends import backend_for
from memplan.probe.dedup import ForwardMisses
from memplan.probe.expand import NotLinear, expand, same_profile
from memplan.probe.meta_kernels import rnn_notes
from memplan.probe.repeats import LENGTHS, longest_run, shrink, shrunk_copy
from memplan.probe.sameness import Declined, shared_state, traced_reason
from memplan.probe.session import Session, SizeRuns, open_session, resolve_layers, warm_up
from memplan.probe.settings import TIMING_ROUNDS, ProbeSettings
from memplan.probe.sizes import (
    SelectiveFailed,
    available_bytes,
    drop_uncheckpointable,
    estimated_bytes,
    refuse_unfit_first_size,
    refuse_unfit_size,
    rounds_phrase,
    run_size,
    selective_off,
    time_extra_size,
    try_selective,
    without_selective,
)
from memplan.profile import Profile

T = TypeVar("T")

__all__ = ["TIMING_EXTRA_FACTOR", "TIMING_ROUNDS", "available_bytes", "probe_model"]

TIMING_EXTRA_FACTOR = 4
"""Times (only) are also taken at this multiple of the largest probed size."""

Progress = Callable[[int, int, str], None]


# ------------------------------------------------------------------------------ entry
def probe_model(
    model_file_path: str | ModelFile,
    *,
    device: str = "auto",
    micro_batches: Sequence[int] = (1, 2, 4),
    precision: str = "fp32",
    layers: str | None = None,
    device_profile: str | None = None,
    on_progress: Progress | None = None,
    mixed_precision: str = "autocast",
    reuse_identical: bool = True,
    float8_recipe: str = "tensorwise",
    float8_all_gather: bool = True,
    compiled: bool = False,
    timing_rounds: int = TIMING_ROUNDS,
) -> Profile:
    """Measure ``model_file_path`` (or a loaded ModelFile: memplan.integrations.api builds
    one around a live model) per layer and return its Profile (see profile.py). On
    meta, identical blocks reuse their representative's meta results unless
    ``reuse_identical`` is False (memplan.probe.dedup)."""
    sizes = sorted(set(int(b) for b in micro_batches))
    settings = ProbeSettings(
        device=device,
        micro_batches=tuple(sizes),
        precision=precision,
        layers=layers,
        device_profile=device_profile,
        mixed_precision=mixed_precision,
        reuse_identical=reuse_identical,
        float8_recipe=float8_recipe,
        float8_all_gather=float8_all_gather,
        compiled=compiled,
        timing_rounds=timing_rounds,
    )
    if len(sizes) < 2 or sizes[0] < 1:
        raise BadInputError(
            f"micro_batches {tuple(micro_batches)} must hold at least two distinct positive sizes.",
            hint="For example 1,2,4: affine fits need two sizes; three give a residual.",
        )
    total = (
        3 + (6 + (device != "meta")) * len(sizes) + 1 + (device != "meta")
    )  # building, warm-up, checkpointing trial; + the timing-only size
    done = 0

    def tick(what: str) -> None:
        nonlocal done, total
        done += 1
        total = max(total, done)  # a size run again without selective checkpointing
        if on_progress is not None:
            on_progress(done, total, what)

    model_file = (
        model_file_path
        if isinstance(model_file_path, ModelFile)
        else load_model_file(model_file_path)
    )
    try:
        declined = None
        if device == "meta" and reuse_identical:
            derived = _probe_repeats(model_file, settings, tick)
            if isinstance(derived, Profile):
                return derived
            if derived is not None:
                declined = derived.reason
        profile = probe_sizes(model_file, settings, tick)
        if declined is not None:
            profile = dataclasses.replace(profile, extrapolation_declined=declined)
        return profile
    except Exception as exc:
        known = checkpointing_failure(exc, model_file.spec)
        if known is None:
            raise
        raise known from exc


def _selective_dropped_on_failure(
    session: Session, size: int, runs: list[SizeRuns], step: Callable[[], T]
) -> tuple[list[SizeRuns], T]:
    """``runs`` and what ``step`` (the runs of ``size``, measured or timing-only) returns.
    Selective checkpointing that fails in it (``SelectiveFailed``) is dropped from the whole
    profile, the earlier sizes' selective figures with it, and ``step`` runs again."""
    try:
        return runs, step()
    except SelectiveFailed as failed:
        selective_off(session, failed.cause, size)
        return [without_selective(r) for r in runs], step()


def _probe_repeats(
    model_file: ModelFile, settings: ProbeSettings, tick: Callable[[str], None]
) -> Profile | Declined | None:
    """A long run of identical blocks probed at three short lengths and the rest derived
    (memplan.probe.repeats); None when the model has no run of look-alike blocks, and
    ``Declined`` (with the reason) when memplan cannot show that its blocks are the same
    (memplan.probe.sameness) or its short probes do not extrapolate exactly: the caller then
    probes every block. Failures are not declines: they surface as they would in a full
    probe (memplan's own as exit 3 naming the op)."""
    backend = backend_for(settings)  # meta, identical blocks reused: the caller's settings
    model = backend.build(model_file)
    names, _ = resolve_layers(model, settings.layers)
    repeat = longest_run(model, names)
    if repeat is None:
        return None
    reason = shared_state(model, repeat)
    if reason is not None:
        return Declined(reason)
    whole = copy.deepcopy(model)  # traced (a forward may fill caches); the probes cut `model`
    shrink(model, repeat, LENGTHS[-1])  # built once: 10,000 blocks take seconds to build
    longest = dataclasses.replace(repeat, length=LENGTHS[-1])
    cuts = [
        (shrunk_copy(model, longest, length), dataclasses.replace(repeat, length=length))
        for length in LENGTHS
    ]
    reason = traced_reason(model_file, backend, whole, repeat, settings.micro_batches[0], cuts)
    del whole, cuts
    if reason is not None:
        return Declined(reason)
    short = [
        probe_sizes(
            model_file,
            settings,
            tick if k == 0 else lambda what: None,
            prune=False,
            build=functools.partial(shrunk_copy, model, longest, length),
        )
        for k, length in enumerate(LENGTHS)
    ]
    a = repeat.first
    try:
        check = expand(short[0], short[1], a, LENGTHS[2], short[2].layer_names, prune=False)
    except NotLinear as exc:
        return Declined(f"the probes of 4 and 5 blocks do not extrapolate ({exc})")
    if not same_profile(check, short[2]):
        return Declined(
            "the probe of 6 blocks differs from what the probes of 4 and 5 blocks predict"
        )
    try:
        return expand(short[0], short[1], a, repeat.length, names, prune=True)
    except NotLinear as exc:
        return Declined(f"the probes of 4 and 5 blocks do not extrapolate ({exc})")


def probe_sizes(
    model_file: ModelFile,
    settings: ProbeSettings,
    tick: Callable[[str], None],
    *,
    prune: bool = True,
    build: Callable[[], torch.nn.Module] | None = None,
) -> Profile:
    """One profile of ``model_file`` at each of ``settings.micro_batches`` (sorted, two at
    least); ``build`` makes the model instead of the file's factory (the shortcut's cuts).
    ``tick(what)`` is called as each phase starts, with what it is about to run: a progress
    display shows it as the phase under way (memplan.render.progress)."""
    sizes = list(settings.micro_batches)
    backend = backend_for(settings)
    tick("building the model")
    session = open_session(model_file, backend, settings.layers, build)
    if not session.layer_names:
        session.warnings.append(
            "No repeated blocks (an nn.ModuleList/nn.Sequential of "
            "same-type modules) found: no checkpoint candidates. Name "
            "some with --layers GLOB."
        )
    cuda = backend.device == "cuda"
    forward_misses = (
        None
        if backend.op_cache is None
        else ForwardMisses(backend.op_cache, session.layers, session.layer_names)
    )
    tick("warm-up step")
    refuse_unfit_first_size(session, sizes[0])
    try:
        warm_up(session, sizes[0])
        drop_uncheckpointable(session, sizes[0], tick)
    except torch.OutOfMemoryError as exc:
        raise CannotMeasureError(
            f"Out of GPU memory at the smallest micro-batch ({sizes[0]}) during the warm-up "
            "steps (plain, then every candidate checkpointed).",
            hint="The model does not train on this GPU even at that size; try --device meta "
            "with a larger GPU spec.",
        ) from exc
    try_selective(session, sizes[0])
    runs: list[SizeRuns] = []
    extra: dict[str, Any] = {}
    for size in sizes:
        if runs:
            refuse_unfit_size(session, runs[0], size)
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            runs, ran = _selective_dropped_on_failure(
                session, size, runs, lambda size=size: run_size(session, size, tick)
            )
            runs.append(ran)
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
        rounds = rounds_phrase(backend.timing_rounds)
        tick(f"b={TIMING_EXTRA_FACTOR * sizes[-1]}: timing only ({rounds})")
        timing_only = TIMING_EXTRA_FACTOR * sizes[-1]
        runs, extra_timed = _selective_dropped_on_failure(
            session, timing_only, runs, lambda: time_extra_size(session, timing_only)
        )
    session.warnings.extend(backend.attention_notes)  # what the spec left undecided
    if backend.device == "meta":
        session.warnings.extend(rnn_notes(session.model))
    tick("fitting the timeline")
    profile = assemble(session, runs, extra, extra_timed, prune=prune)
    if forward_misses is not None:
        forward_misses.remove()
        profile = dataclasses.replace(
            profile, deduplicated_layers=forward_misses.reusing(session.layer_names)
        )
    session.recorder.remove()
    return _with_tp(session, profile, sizes[0], tick)


def ddp_refusal(forward_grads: tuple[str, ...]) -> str | None:
    """``Profile.ddp_refused`` from the parameters whose gradients a forward made."""
    if not forward_grads:
        return None
    shown = ", ".join(forward_grads[:3]) + (
        f" and {len(forward_grads) - 3} more" if len(forward_grads) > 3 else ""
    )
    return (
        f"its forward made the gradients of {shown} (the loss runs a backward of its own, "
        "as a chunked loss does), which DDP's reducer refuses"
    )


def _running_world() -> int:
    """Ranks of a process group the caller already started (0: none). The TP probe starts a
    fake group of its own, which torch cannot do beside one: under a Trainer's DeepSpeed (a
    group of 1) it failed, and the probe warned "its blocks failed under its TP plan"."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 0


def _with_tp(session: Session, profile: Profile, size: int, tick: Callable[[str], None]) -> Profile:
    """The profile with what tensor parallelism divides (memplan.probe.tp_measure) and
    whether pipeline stages can split the model (``Profile.pipeline_refused``); a model
    without a TP plan, or whose blocks cannot run under one, records why in
    ``Profile.tp_refused`` (and the latter in a warning)."""
    from memplan.probe.tp_measure import TP_PROBE_DEGREE, declared_plan, measure_tp
    from memplan.run.pipeline import pipeline_refusal
    from memplan.run.tp_plan import tp_plan_for

    profile = dataclasses.replace(
        profile,
        pipeline_refused=pipeline_refusal(session.model),
        ddp_refused=ddp_refusal(session.forward_grads),
    )
    try:
        declared = declared_plan(session.model_file.module, session.model)
        tp_plan_for(session.model, declared)
    except BadInputError as exc:  # no TP plan: nothing to measure
        return dataclasses.replace(profile, tp_refused=exc.message.strip().splitlines()[0])
    running = _running_world()
    if running and running != TP_PROBE_DEGREE:  # a script's own group (DeepSpeed's one rank)
        return dataclasses.replace(
            profile,
            tp_refused=f"not measured: a process group of {running} rank(s) was already "
            f"running, and TP is measured on a fake group of {TP_PROBE_DEGREE} ranks of the "
            "probe's own; probe the model outside it (memplan probe, or before "
            "init_process_group) to plan TP.",
        )
    tick("measuring the blocks under TP 2 (fake process group)")
    try:
        measured = measure_tp(session, profile, size, declared)
    except Exception as exc:
        # what failed, without a model-file hint that blames the batch: the batch ran the
        # whole probe; here the blocks run again under TP 2 on a fake process group
        said = exc.message if isinstance(exc, MemplanError) else str(exc)
        said = (said.strip().splitlines() or [""])[0]
        why = f"its blocks failed under its TP plan ({type(exc).__name__}: {said})"
        note = f"Tensor parallelism was not measured: {why}; plans with --tp > 1 are refused."
        return dataclasses.replace(
            profile, warnings=(*profile.warnings, note), tp_refused=f"{why}."
        )
    return measured
