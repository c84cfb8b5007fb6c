"""What tensor parallelism divides, measured (issue 25): each block is run once more under
TP 2 on one process, with a fake process group (``torch.testing._internal.distributed.
fake_pg``: collectives return at once) and DTensor's ``parallelize_module`` on a CPU mesh
with the model's own TP plan (memplan.run.tp_plan). From the bytes its forward saves for
backward, plain and under TP 2::

    saved(t) = outside + inside / t   ⇒   inside = 2·(saved(1) − saved(2))

and ``Layer.tp_saved_fraction = inside / saved(1)``. Parameters are never counted as saved
(their storages are skipped). ``tp_sharded_bytes`` is what the TP plan took off the block's
parameters on one rank, × 2 (the whole of what is split). Fixed parts (embedding, head)
are not run: a module the plan names has its weight split (its bias too when colwise),
from the shapes. Blocks alike (same class, parameter shapes, input shapes) are run once.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.profile import Profile
from memplan.run.tp_plan import tp_modules, tp_plan_for

TP_PROBE_DEGREE = 2


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    storage = local.untyped_storage()
    return storage._cdata, storage.nbytes()


def saved_activation_bytes(module: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes of the distinct storages ``module``'s forward saves for backward, parameters
    left out."""
    params = {_storage_key(p)[0] for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage_key(t)
        if key not in params:
            seen[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    del out
    return sum(seen.values())


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
        with torch.no_grad(), session.backend.forward_context():
            session.model_file.loss(session.model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return got


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
        return _measured(session, profile, split, inputs)
    finally:
        if started:
            dist.destroy_process_group()


def _measured(session: Any, profile: Profile, split: dict[str, str], inputs: dict) -> Profile:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = session.model
    mesh = init_device_mesh("cpu", (TP_PROBE_DEGREE,))
    by_signature: dict[tuple, tuple[float, int]] = {}
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
            whole = saved_activation_bytes(plain, *(_fresh(args), _fresh(kwargs)))
            tp = copy.deepcopy(module)
            torch_styles = {n: _style(s) for n, s in styles.items()}
            parallelize_module(tp, mesh, {n: s for n, s in torch_styles.items() if s})
            under_tp = saved_activation_bytes(tp, *(_fresh(args), _fresh(kwargs)))
            inside = TP_PROBE_DEGREE * (whole - under_tp)
            fraction = min(max(inside / whole, 0.0), 1.0) if whole > 0 else 0.0
            sharded = TP_PROBE_DEGREE * (_local_param_bytes(plain) - _local_param_bytes(tp))
            by_signature[sig] = (fraction, sharded // (TP_PROBE_DEGREE - 1))
        fraction, sharded = by_signature.get(sig, (0.0, 0))
        layers.append(
            dataclasses.replace(layer, tp_saved_fraction=fraction, tp_sharded_bytes=sharded)
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
