"""Assembling a Profile from the runs of every probed size: layers, fixed parts, the timeline and
the totals, each fitted across sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memplan.probe.alignment import (
    backward_seconds,
    consistent_runs,
    fit_sizes,
    fit_time,
    fit_timeline,
    measured_savings,
    shared_inputs,
    unique_params,
    window_peak,
)
from memplan.probe.clock_mix import fixed_clock, layer_clocks
from memplan.probe.layers import has_batchnorm, hf_blocks, own_params_owners, param_bytes
from memplan.probe.session import Run, Session, SizeRuns
from memplan.probe.sizes import TimedSize
from memplan.probe.tracker import state_tensors, storages_bytes
from memplan.profile import (
    OP_SEQUENCE_DIFFERED,
    Affine,
    ClockMix,
    Environment,
    FixedPart,
    Layer,
    ModelRef,
    Profile,
    SharedInput,
    Totals,
)
from memplan.version import __version__

AFFINE_TOLERANCE = 0.01
"""A byte quantity whose fit misses a measured size by more than 1% is flagged non-affine."""


@dataclass(frozen=True, slots=True)
class _Sizes:
    """The runs fitted across sizes: tracked runs for bytes, timed runs (one more size when
    an extra timing size was run) for seconds."""

    runs: list[SizeRuns]
    timed: list[TimedSize]

    @property
    def sizes(self) -> list[int]:
        return [r.size for r in self.runs]

    @property
    def time_sizes(self) -> list[int]:
        return [t.size for t in self.timed]

    def bytes_fit(self, value: Callable[[SizeRuns], float]) -> Affine:
        return fit_sizes(self.sizes, [value(r) for r in self.runs])

    def seconds_fit(self, value: Callable[[TimedSize], float]) -> Affine:
        return fit_time(self.time_sizes, [value(t) for t in self.timed])


def assemble(
    session: Session,
    runs: list[SizeRuns],
    extra: dict[str, Any],
    extra_timed: TimedSize | None = None,
    *,
    prune: bool = True,
) -> Profile:
    """The Profile of ``session`` from the runs of every probed size (and the timing-only
    ``extra_timed``): layers, fixed parts, timeline and totals, each fitted across sizes.
    Warnings collect in the order the steps find them."""
    warnings = list(session.warnings)
    probed = tuple(r.size for r in runs)
    fits = _sizes(consistent_runs(runs, warnings), extra_timed)
    shared = shared_inputs(fits.runs, warnings)
    savings = [
        fits.bytes_fit(lambda r, j=j: measured_savings(r, j))
        for j in range(len(session.layer_names))
    ]
    selective_savings = _selective_savings(fits, len(session.layer_names))
    clocks = layer_clocks(fits.runs)
    layers = [
        _layer(session, fits, j, savings[j], selective_savings, warnings, clocks[j])
        for j in range(len(session.layer_names))
    ]
    fixed = [*_ran_parts(session, fits), *_own_params_parts(session, fits), *_loss_part(fits)]
    timeline, stable = _timelines(fits, savings, selective_savings, warnings, prune, shared)
    bn = has_batchnorm(session.model)
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
        environment=_environment(session),
        micro_batches=probed,
        totals=_totals(session, fits.runs[-1].grads),
        layers=tuple(layers),
        fixed=tuple(fixed),
        timeline=timeline,
        optimizer_step_peak_bytes=fits.bytes_fit(lambda r: r.optimizer.peak_bytes),
        optimizer_step_seconds=fits.seconds_fit(lambda t: t.optimizer_seconds),
        step_fixed_seconds=fits.seconds_fit(_step_fixed_seconds),
        allocator_reserve_bytes=extra.get("allocator_reserve_bytes"),
        context_bytes=extra.get("context_bytes"),
        has_batchnorm=bn,
        op_sequence_stable=stable,
        warnings=tuple(dict.fromkeys(warnings)),
        seq_len=probed_length(session.model_file),
        max_seq_len=session.model_file.max_seq_len,
        hf_blocks=hf_blocks(session.model),
        fixed_clock=fixed_clock(fits.runs),
        shared_inputs=shared,
    )


def _sizes(runs: list[SizeRuns], extra_timed: TimedSize | None) -> _Sizes:
    timed = [
        TimedSize(r.size, r.timing, r.optimizer_seconds, r.full_seconds, r.selective_seconds)
        for r in runs
    ]
    if extra_timed is not None:
        timed.append(extra_timed)
    return _Sizes(runs=runs, timed=timed)


def _selective_savings(fits: _Sizes, n_layers: int) -> list[Affine] | None:
    """Each layer's savings in the all-selective run, when every size ran one (not on meta)."""
    if not all(r.sel_no_grads is not None for r in fits.runs):
        return None
    return [
        fits.bytes_fit(lambda r, j=j: measured_savings(r, j, "sel_no_grads"))
        for j in range(n_layers)
    ]


def _rec(run: Run, j: int) -> Any:
    assert run.record is not None
    return run.record.layers[j]


def _saved(run: Run, j: int) -> int:
    return _rec(run, j).post_live - _rec(run, j).pre_live


def _fwd_transient(r: SizeRuns, j: int) -> int:
    x = _rec(r.no_grads, j)
    return window_peak(r.no_grads.values, x.pre_pos, x.post_pos, x.pre_live)


def _bwd_transient(r: SizeRuns, j: int, ckpt: bool = False) -> int:
    run = r.ckpt_no_grads if ckpt else r.no_grads
    x = _rec(run, j)
    return window_peak(run.values, x.bwd_pos0, x.bwd_pos1, x.bwd_live0) if x.bwd_pos0 >= 0 else 0


def _layer(
    session: Session,
    fits: _Sizes,
    j: int,
    savings: Affine,
    selective_savings: list[Affine] | None,
    warnings: list[str],
    clocks: dict[str, tuple[ClockMix, ...]],
) -> Layer:
    """Layer ``j``: its parameters and state, each byte quantity and time fitted across
    sizes, its meta clock's bins (``clocks``, memplan.probe.clock_mix.layer_clocks); a byte
    quantity that is not affine adds a warning."""
    name = session.layer_names[j]
    module = dict(session.model.named_modules())[name]
    params = unique_params(module)
    trainable, frozen = param_bytes(module)
    grads, state = fits.runs[-1].grads, fits.runs[-1].state
    byte_fits = {
        "input_bytes": fits.bytes_fit(lambda r: _rec(r.no_grads, j).input_bytes),
        "output_bytes": fits.bytes_fit(lambda r: _rec(r.no_grads, j).output_bytes),
        "saved_bytes": fits.bytes_fit(lambda r: _saved(r.no_grads, j)),
        "savings_bytes": savings,
        "fwd_transient_bytes": fits.bytes_fit(lambda r: _fwd_transient(r, j)),
        "bwd_transient_bytes": fits.bytes_fit(lambda r: _bwd_transient(r, j)),
        "recompute_transient_bytes": fits.bytes_fit(lambda r: _bwd_transient(r, j, True)),
    }
    # Recorded, not warned: solve says so when a plan extrapolates from such a layer (a
    # micro-batch outside the probed sizes), the one case where it changes what to do.
    is_affine = all(f.residual <= AFFINE_TOLERANCE for f in byte_fits.values())
    sel_timed = all(t.selective_seconds is not None for t in fits.timed)
    return Layer(
        name=name,
        module_type=type(module).__name__,
        params_trainable_bytes=trainable,
        params_frozen_bytes=frozen,
        grad_bytes=sum(grads.get(id(p), 0) for p in params),
        optimizer_state_bytes=sum(state.get(id(p), 0) for p in params),
        **byte_fits,
        fwd_seconds=fits.seconds_fit(
            lambda t: t.timing.layers[j].fwd_t1 - t.timing.layers[j].fwd_t0
        ),
        bwd_seconds=fits.seconds_fit(
            lambda t: backward_seconds(t.timing.layers[j].bwd_t0, t.timing.layers[j].bwd_t1)
        ),
        fwd_flops=fits.bytes_fit(lambda r: _rec(r.no_grads, j).flops),
        recompute_seconds=None
        if any(t.full_seconds is None for t in fits.timed)
        else fits.seconds_fit(lambda t: t.full_seconds[j]),  # type: ignore[index]
        selective_savings_bytes=selective_savings[j] if selective_savings else None,
        selective_recompute_seconds=fits.seconds_fit(
            lambda t: t.selective_seconds[j]  # type: ignore[index]
        )
        if selective_savings and sel_timed
        else None,
        float8_param_bytes=session.backend.float8.param_bytes_under(name)
        if session.backend.float8
        else 0,
        affine=is_affine,
        has_batchnorm=has_batchnorm(module),
        fwd_clock=clocks["fwd_clock"],
        bwd_clock=clocks["bwd_clock"],
        selective_clock=clocks["selective_clock"] if sel_timed else (),
    )


def _ran_parts(session: Session, fits: _Sizes) -> list[FixedPart]:
    """Modules outside the layers that ran in the forward, in the order they first ran."""
    first = fits.runs[0].no_grads.record
    assert first is not None
    modules = dict(session.model.named_modules())
    grads, state = fits.runs[-1].grads, fits.runs[-1].state
    fixed = []
    for name in sorted(first.parts, key=lambda n: first.parts[n].first_seen):
        module = modules[name]
        params = unique_params(module)
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
                saved_bytes=fits.bytes_fit(lambda r: part(r.no_grads).saved_bytes),
                fwd_seconds=fits.seconds_fit(lambda t: part(t.timing).fwd_seconds),
                bwd_seconds=fits.seconds_fit(
                    lambda t: backward_seconds(part(t.timing).bwd_t0, part(t.timing).bwd_t1)
                ),
                fwd_flops=fits.bytes_fit(lambda r: part(r.no_grads).flops),
                float8_param_bytes=session.backend.float8.param_bytes_under(name)
                if session.backend.float8
                else 0,
            )
        )
    return fixed


def _own_params_parts(session: Session, fits: _Sizes) -> list[FixedPart]:
    """Parameters held directly by ancestors of the layers (no time, no activations)."""
    modules = dict(session.model.named_modules())
    grads, state = fits.runs[-1].grads, fits.runs[-1].state
    fixed = []
    for owner in own_params_owners(session.model, session.layer_names):
        module = modules[owner]
        params = unique_params(module, recurse=False)
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
    return fixed


def _loss_part(fits: _Sizes) -> list[FixedPart]:
    """The loss computed outside the model's forward, when it saved or computed anything."""
    loss_saved = [r.no_grads.record.loss_saved_bytes for r in fits.runs]  # type: ignore[union-attr]
    loss_flops = [r.no_grads.record.loss_flops for r in fits.runs]  # type: ignore[union-attr]
    if not (any(loss_saved) or any(loss_flops)):
        return []
    return [
        FixedPart(
            name="(loss)",
            module_type="training_loss",
            params_trainable_bytes=0,
            params_frozen_bytes=0,
            grad_bytes=0,
            optimizer_state_bytes=0,
            saved_bytes=fit_sizes(fits.sizes, loss_saved),
            fwd_seconds=fits.seconds_fit(lambda t: t.timing.loss_seconds),
            bwd_seconds=Affine.zero(),
            fwd_flops=fit_sizes(fits.sizes, loss_flops),
        )
    ]


def _timelines(
    fits: _Sizes,
    savings: list[Affine],
    selective_savings: list[Affine] | None,
    warnings: list[str],
    prune: bool = True,
    shared: tuple[SharedInput, ...] = (),
) -> tuple[dict[str, Any], bool]:
    """Both phases' segments, and whether the op sequence was the same at every size (if not,
    segment maxima were fitted and a warning says so)."""
    runs = fits.runs
    timeline = {}
    stable = True
    for phase in ("no_grads", "grads_resident"):
        segs, ok = fit_timeline(
            fits.sizes,
            [getattr(r, phase) for r in runs],
            [getattr(r, f"ckpt_{phase}") for r in runs],
            savings,
            warnings,
            [getattr(r, f"sel_{phase}") for r in runs] if selective_savings is not None else None,
            selective_savings,
            prune,
            shared,
        )
        timeline[phase] = segs
        stable &= ok
    if not stable:
        warnings.append(
            f"The {OP_SEQUENCE_DIFFERED} between probed sizes (data-dependent "
            "routing?): segment maxima were fitted, not points; verify plans at "
            "their micro-batch."
        )
    return timeline, stable


def _step_fixed_seconds(r: TimedSize) -> float:
    """A micro-step's time outside the layers (and outside their backward)."""
    t = r.timing
    in_layers = sum(x.fwd_t1 - x.fwd_t0 + backward_seconds(x.bwd_t0, x.bwd_t1) for x in t.layers)
    return (t.t_end - t.t_start) - in_layers


def probed_length(model_file: Any) -> int | None:
    """Tokens per sample of the batches probed, where the model says it: the length
    ``make_batch`` is called with, or an ``hf:`` reference's ``seq-len`` (before, such a
    profile recorded none, so its plan and the torchtitan and Megatron files carried no
    length, and ``solve --seq-len`` at the very length probed was refused). None: a model
    file's own batches."""
    if model_file.seq_len is not None:
        return model_file.seq_len
    if model_file.reference is None:
        return None
    from memplan.model.hf import parse_reference

    return parse_reference(model_file.reference).seq_len


def _environment(session: Session) -> Environment:
    backend = session.backend
    first_param = next(session.model.parameters())
    return Environment(
        torch_version=str(torch.__version__),
        memplan_version=__version__,
        device=backend.device,  # type: ignore[arg-type]
        device_name=backend.device_name(),
        device_capacity_bytes=backend.capacity_bytes(),
        device_profile=backend.target_profile(),
        device_spec_digest=backend.target_digest(),
        precision=backend.precision,  # type: ignore[arg-type]
        optimizer_class=type(session.optimizer).__name__,
        param_dtype=str(first_param.dtype).removeprefix("torch."),
        mixed_precision=backend.mixed_precision,  # type: ignore[arg-type]
        float8=backend.float8.environment(meta_clock=backend.device == "meta")
        if backend.float8
        else None,
        compiled=backend.compiled,
        timing_rounds=None if backend.device == "meta" else backend.timing_rounds,
    )


def _cached_bytes(session: Session) -> int:
    """Bytes of the tensors the model came to keep between steps (``Session.kept_tensors``)
    outside its parameters, buffers, gradients and optimizer state, counted after the last
    probed step, when every cache a step fills is full; tensors it held before its first
    step (a dataset in a module-level variable) are not the device's."""
    model = session.model
    known = {
        id(t.untyped_storage())
        for t in [*model.parameters(), *model.buffers()]
        + [p.grad for p in model.parameters() if p.grad is not None]
        + [t for s in session.optimizer.state.values() for t in state_tensors(s)]
        + list(session.kept_at_start)
    }
    kept = session.kept_tensors()
    return storages_bytes(t for t in kept if id(t.untyped_storage()) not in known)


def _totals(session: Session, grads: dict[int, int]) -> Totals:
    params_trainable, params_frozen = param_bytes(session.model)
    return Totals(
        cached_bytes=_cached_bytes(session),
        params_trainable_bytes=params_trainable,
        params_frozen_bytes=params_frozen,
        buffer_bytes=storages_bytes(session.model.buffers()),
        grad_bytes=sum(grads.values()),
        optimizer_state_bytes=storages_bytes(
            t for s in session.optimizer.state.values() for t in state_tensors(s)
        ),
    )
