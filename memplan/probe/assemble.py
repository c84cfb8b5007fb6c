"""Assembling a Profile from the runs of every probed size: layers, fixed parts, the timeline and
the totals, each fitted across sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import memplan
import memplan.runtime
from memplan.probe.alignment import (
    _bwd_seconds,
    _consistent_runs,
    _fit,
    _fit_time,
    _layer_seconds,
    _savings,
    _timeline,
    _unique_params,
    _window_peak,
)
from memplan.probe.layers import has_batchnorm, own_params_owners, param_bytes
from memplan.probe.session import Run, Session, SizeRuns
from memplan.probe.sizes import TimedSize
from memplan.probe.tracker import state_tensors, storages_bytes
from memplan.profile import (
    Affine,
    Environment,
    FixedPart,
    Layer,
    ModelRef,
    Profile,
    Totals,
)

AFFINE_TOLERANCE = 0.01
"""A byte quantity whose fit misses a measured size by more than 1% is flagged non-affine."""


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
