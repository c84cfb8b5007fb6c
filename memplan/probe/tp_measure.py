"""What tensor parallelism divides, measured (issue 25): each block is run once more under
TP 2 on one process, with a fake process group (``torch.testing._internal.distributed.
fake_pg``: collectives return at once) and DTensor's ``parallelize_module`` on a CPU mesh
with the model's own TP plan (memplan.run.tp_plan). From the bytes its forward keeps for
backward (:func:`kept_activation_bytes`), plain and under TP 2::

    kept(t) = outside + inside / t   ⇒   inside = 2·(kept(1) − kept(2))

and ``Layer.tp_saved_fraction = inside / kept(1)``; the same of the block under selective
checkpointing (memplan.modes) is ``Layer.tp_selective_fraction``, when the profile has
selective figures. ``tp_sharded_bytes`` is what the TP plan took off the block's
parameters on one rank, × 2 (the whole of what is split); ``tp_gemms`` the split linears'
GEMM shapes (memplan.probe.tp_gemms). Fixed parts (embedding, head)
are not run: a module the plan names has its weight split (its bias too when colwise),
from the shapes. Blocks alike (same class, parameter shapes, input shapes) are run once.
On meta the blocks run as the probe runs them: with CPU twins of small tensors, the target
device's attention kernels and autocast (memplan.probe.backends).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import BadInputError
from memplan.modes import KEEP, SELECTIVE
from memplan.probe.tp_gemms import gemm_shapes
from memplan.probe.tracker import LiveTracker, tensors_in
from memplan.profile import Profile, TpGemm
from memplan.run.checkpoint import in_mode
from memplan.run.tp_plan import tp_degree_divides, tp_modules, tp_plan_for

TP_PROBE_DEGREE = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = _local(t).untyped_storage()
    return storage._cdata, storage.nbytes()


class _Created(TorchDispatchMode):
    """The storages the ops of a forward create (a DTensor's by its local shard), each with
    a weak reference whose callback forgets it when it is freed (its id may be reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for tensor in tensors_in(out, []):
            try:
                storage = _local(tensor).untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage of its own
                continue
            key = storage._cdata
            if key not in self.alive:
                forget = functools.partial(self._forget, key)
                self.alive[key] = (weakref.ref(storage, forget), storage.nbytes())
        return out

    def _forget(self, key: int, _ref: weakref.ref) -> None:
        entry = self.alive.get(key)
        if entry is not None and entry[0] is _ref:
            del self.alive[key]


def kept_activation_bytes(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    mode: str = KEEP,
    context_fn: Any = None,
) -> int:
    """Bytes of the distinct storages ``module``'s forward in ``mode`` (memplan.modes)
    creates and leaves alive while its output is held: what it keeps for backward, and its
    output, as the probe's ``saved_bytes`` counts a layer (what existed before, parameters,
    buffers and inputs, and views of it, left out). Counted from the storages' lives, not from saved-tensor hooks, which a
    checkpoint's own hooks hide: a block under selective or full checkpointing (or one that
    checkpoints itself) is measured too. ``context_fn`` as memplan.run.checkpoint's."""
    existing = [*module.parameters(), *module.buffers(), *tensors_in((args, kwargs), [])]
    before = {_storage_key(t)[0] for t in existing}  # and views of them: not created here
    created = _Created()
    chosen = nullcontext() if mode == KEEP else in_mode([module], mode, context_fn=context_fn)
    with chosen, created:
        out = module(*args, **kwargs)
    kept = sum(n for key, (ref, n) in created.alive.items() if key not in before and ref())
    del out
    return kept


def saved_activation_bytes(module: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """:func:`kept_activation_bytes` of the plain forward."""
    return kept_activation_bytes(module, args, kwargs)


def _local_param_bytes(module: torch.nn.Module) -> int:
    return sum(_storage_key(p)[1] for p in module.parameters())


def _fresh(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().clone()
        return t.requires_grad_(t.is_floating_point())
    if isinstance(value, tuple | list):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _signature(module: torch.nn.Module) -> tuple:
    return (
        type(module).__name__,
        tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
    )


def capture_inputs(session: Any, size: int) -> dict[tuple, tuple[tuple, dict]]:
    """The inputs of the first block of each kind, from one forward at ``size`` samples."""
    got: dict[tuple, tuple[tuple, dict]] = {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        sig = _signature(module)
        if sig not in got:
            got[sig] = (_fresh(args), _fresh(kwargs))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in session.layers]
    batch = session.backend.batch(session.model_file, size)
    try:
        with torch.no_grad(), _as_probed(session.backend), session.backend.forward_context():
            session.model_file.loss(session.model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return got


def _as_probed(backend: Any) -> Any:
    """On meta, the CPU twins that answer value reads (memplan.probe.shadow) without the
    probe's op cache, which has no key for DTensor arguments; elsewhere nothing."""
    return LiveTracker(record=False, meta=True) if backend.device == "meta" else nullcontext()


def _style(style: str) -> Any:
    """The torch ParallelStyle of a transformers style name (as transformers'
    ``tensor_parallel.py`` registers them). Styles that split no weight map to None."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style in ("colwise", "local_colwise"):
        return ColwiseParallel()
    if style in ("rowwise", "local_rowwise"):
        return RowwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output", "embedding_colwise"):
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    return None


def _fake_world(degree: int) -> bool:
    """Start a fake process group of ``degree`` ranks unless one exists; True if started."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        return False
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    return True


def declared_plan(module: Any, model: torch.nn.Module) -> Any:
    """The TP plan a model file declares: ``TP_PLAN``, or ``tp_plan(model)``; else None."""
    plan = getattr(module, "TP_PLAN", None)
    make = getattr(module, "tp_plan", None)
    if plan is None and callable(make):
        plan = make(model)
    return plan


def _fixed_sharded_bytes(module: torch.nn.Module, style: str) -> int:
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    total = weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0
    if style.startswith("colwise") and isinstance(bias, torch.Tensor):
        total += bias.numel() * bias.element_size()
    return total


def measure_tp(session: Any, profile: Profile, size: int, declared: Any = None) -> Profile:
    """``profile`` with each block's ``tp_saved_fraction`` and ``tp_sharded_bytes`` and each
    fixed part's ``tp_sharded_bytes`` measured (module docstring). A model without a TP
    plan comes back unchanged (TP is refused when planned)."""
    import torch.distributed as dist

    model = session.model
    try:
        plan = tp_plan_for(model, declared)
    except BadInputError:  # no plan: nothing to measure
        return profile
    split = tp_modules(model, plan)
    inputs = capture_inputs(session, size)
    started = _fake_world(TP_PROBE_DEGREE)
    try:
        measured = _measured(session, profile, split, inputs, size)
        return dataclasses.replace(measured, tp_degree_divides=tp_degree_divides(model, split))
    finally:
        if started:
            dist.destroy_process_group()


def _measured(
    session: Any, profile: Profile, split: dict[str, str], inputs: dict, size: int
) -> Profile:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = session.model
    backend = session.backend
    mesh = init_device_mesh("cpu", (TP_PROBE_DEGREE,))
    selective = all(layer.selective_savings_bytes is not None for layer in profile.layers)
    modes = (KEEP, SELECTIVE) if selective else (KEEP,)
    by_signature: dict[tuple, tuple[dict[str, float], int, tuple[TpGemm, ...]]] = {}
    layers = []
    for name, module, layer in zip(
        session.layer_names, session.layers, profile.layers, strict=True
    ):
        sig = _signature(module)
        if sig not in by_signature and sig in inputs:
            args, kwargs = inputs[sig]
            prefix = name + "."
            styles = {n[len(prefix) :]: s for n, s in split.items() if n.startswith(prefix)}
            plain = copy.deepcopy(module)
            tp = copy.deepcopy(module)
            torch_styles = {n: _style(s) for n, s in styles.items()}
            parallelize_module(tp, mesh, {n: s for n, s in torch_styles.items() if s})
            fractions = {}
            with _as_probed(backend), backend.forward_context():
                for mode in modes:
                    whole, under_tp = (
                        kept_activation_bytes(
                            block, _fresh(args), _fresh(kwargs), mode,
                            backend.checkpoint_context_fn(),
                        )
                        for block in (plain, tp)
                    )  # fmt: skip
                    inside = TP_PROBE_DEGREE * (whole - under_tp)
                    fractions[mode] = min(max(inside / whole, 0.0), 1.0) if whole > 0 else 0.0
                gemms = gemm_shapes(plain, styles, _fresh(args), _fresh(kwargs), size)
            sharded = TP_PROBE_DEGREE * (_local_param_bytes(plain) - _local_param_bytes(tp))
            by_signature[sig] = (fractions, sharded // (TP_PROBE_DEGREE - 1), gemms)
        fractions, sharded, gemms = by_signature.get(sig, ({}, 0, ()))
        layers.append(
            dataclasses.replace(
                layer,
                tp_saved_fraction=fractions.get(KEEP, 0.0),
                tp_selective_fraction=fractions.get(SELECTIVE),
                tp_sharded_bytes=sharded,
                tp_gemms=gemms,
            )
        )
    modules = dict(model.named_modules())
    fixed = []
    for part in profile.fixed:
        styles: Mapping[str, str] = {
            n: s for n, s in split.items() if n == part.name or n.startswith(part.name + ".")
        }
        sharded = sum(
            _fixed_sharded_bytes(modules[n], s) for n, s in styles.items() if n in modules
        )
        fixed.append(dataclasses.replace(part, tp_sharded_bytes=sharded))
    return dataclasses.replace(profile, layers=tuple(layers), fixed=tuple(fixed))
