"""How memplan wraps a model for a plan's data-parallel strategy, in an initialised process
group: the one definition that ``memplan verify --world-size N`` runs
(memplan.distributed) and the emitted training scripts import.

* ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` and the model file's
  optimizer;
* ``zero1``: the same DDP, with ``torch.distributed.optim.ZeroRedundancyOptimizer`` around
  the optimizer's class (each rank keeps the state of its parameter partition);
* ``fsdp``: FSDP2 ``fully_shard`` on each of ``plan.shard_units`` and then on the root,
  with ``MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=float32)`` for a
  ``mixed_precision: params`` plan; ``grad_sync: last_micro_step`` gives the model the
  ``no_sync()`` the Accumulator uses (``set_requires_gradient_sync(False)``), and
  ``every_micro_step`` reduce-scatters every micro-step;
* ``zero2`` is DeepSpeed's and refused.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.memory.vocab import FIRST_STAGE_HINTS, first_stage_name
from memplan.plan import Plan


def fsdp_no_sync(model: torch.nn.Module) -> None:
    """Give an FSDP2 module the ``no_sync()`` context manager the Accumulator looks for:
    gradients are accumulated unsharded, without reduce-scatter, inside it (FSDP2's
    ``set_requires_gradient_sync``, "the equivalence of no_sync in FSDP1")."""

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    model.no_sync = no_sync  # type: ignore[assignment]


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_mixed_precision(plan: Plan) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the plan: parameters gathered and computed in the
    plan's precision, gradients reduced (and kept) in fp32; None for fp32 or autocast plans."""
    if getattr(plan, "mixed_precision", "autocast") != "params":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=COMPUTE_DTYPES[plan.precision], reduce_dtype=torch.float32
    )


def edge_modules(
    module: torch.nn.Module, units: Sequence[str]
) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """(lead, tail): the largest modules with parameters outside every shard unit, split as
    memplan.memory.edge_units splits the profile's parts (by name: the embeddings lead)."""
    ancestors = {".".join(u.split(".")[:i]) for u in units for i in range(1, u.count(".") + 1)}
    lead: list[torch.nn.Module] = []
    tail: list[torch.nn.Module] = []

    def visit(prefix: str, parent: torch.nn.Module) -> None:
        for name, child in parent.named_children():
            qualified = f"{prefix}{name}"
            if qualified in units:
                continue
            if qualified in ancestors:
                visit(f"{qualified}.", child)
            elif any(True for _ in child.parameters()):
                (lead if first_stage_name(qualified) else tail).append(child)

    visit("", module)
    return lead, tail


def shard_edge_units(module: torch.nn.Module, units: Sequence[str], options: dict) -> None:
    """torchtitan's units outside the blocks (``Parallel.fsdp_units`` torchtitan-2507,
    torchtitan/distributed/fsdp.py ``apply_fsdp_to_decoder`` of 0.3.0): the embeddings
    resharded after their forward, the norm + head not; both in one unit kept whole when
    they share a parameter (a tied head, as torchtitan groups them)."""
    from torch.distributed.fsdp import fully_shard

    lead, tail = edge_modules(module, units)
    if not lead:
        raise BadInputError(
            "parallel.fsdp_units torchtitan-2507 shards the embeddings as a unit of their own, "
            "but no module outside the plan's shard units is named like embeddings "
            f"({', '.join(FIRST_STAGE_HINTS)}).",
            hint="Plan with --fsdp-units memplan.",
        )
    shared = {id(p) for m in lead for p in m.parameters()} & {
        id(p) for m in tail for p in m.parameters()
    }
    if shared:
        fully_shard([*lead, *tail], **{**options, "reshard_after_forward": False})
        return
    fully_shard(lead, **options)
    if tail:
        fully_shard(tail, **{**options, "reshard_after_forward": False})


def shard_fsdp(net: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` on each of ``plan.shard_units``, then on the root, with the
    plan's mixed-precision policy; accumulation as ``plan.grad_sync`` says."""
    from torch.distributed.fsdp import fully_shard

    modules = dict(net.named_modules())
    missing = [name for name in plan.shard_units if name not in modules]
    if missing:
        raise BadInputError(
            f"The plan's shard_units {', '.join(missing)} are not modules of the model."
        )
    policy = fsdp_mixed_precision(plan)
    options = {} if policy is None else {"mp_policy": policy}
    for name in plan.shard_units:  # one all-gather unit per layer, then the root
        fully_shard(modules[name], **options)
    layout = getattr(plan, "parallel", None)
    if layout is not None and layout.edge_units:
        shard_edge_units(net, plan.shard_units, options)
    fully_shard(net, **options)
    if getattr(plan, "grad_sync", "last_micro_step") == "last_micro_step":
        fsdp_no_sync(net)  # without it, the Accumulator reduce-scatters every micro-step
    return net


def wrap_for_plan(
    net: torch.nn.Module,
    plan: Plan,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    device: torch.device,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """(model to call, optimizer) for ``plan.strategy`` in an initialised process group:
    what ``verify --world-size`` runs and what the emitted torchrun script imports."""
    strategy = plan.strategy
    if strategy == "zero2":
        raise BadInputError(
            "A zero2 plan runs under DeepSpeed (ZeRO stage 2 has no torch engine).",
            hint="Emit --format deepspeed (or accelerate), or solve with --strategy zero1 or fsdp.",
        )
    if strategy == "fsdp":
        shard_fsdp(net, plan)
        return net, make_optimizer(net)
    ids = [device.index] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(
        net, device_ids=ids, gradient_as_bucket_view=True
    )
    optimizer = make_optimizer(net)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {
            k: v for k, v in optimizer.defaults.items() if k in accepted and k != "differentiable"
        }
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), **defaults)
    return model, optimizer
