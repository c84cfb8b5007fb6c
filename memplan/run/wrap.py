"""How memplan wraps a model for a plan's data-parallel strategy, in an initialised process
group: the one definition that ``memplan verify --world-size N`` runs
(memplan.distributed) and the emitted training scripts import.

* ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` and the model file's
  optimizer;
* ``zero1``: the same DDP, with ``torch.distributed.optim.ZeroRedundancyOptimizer`` around
  the optimizer's class (each rank keeps the state of its parameter partition);
* ``fsdp``: FSDP2 ``fully_shard`` on each of ``plan.shard_units`` (units sharing a
  parameter, such as ALBERT-style blocks sharing one linear, as one unit: FSDP2 lets one
  unit only manage a parameter) and then on the root, with ``MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=float32)`` for a
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


def _under(name: str, units: Sequence[str]) -> str | None:
    """The unit ``name`` (a parameter's or module's qualified name) lies in, if any."""
    for unit in units:
        if name == unit or name.startswith(f"{unit}."):
            return unit
    return None


def fsdp_unit_groups(
    net: torch.nn.Module, units: Sequence[str]
) -> tuple[list[list[str]], list[str]]:
    """(groups, unsharded): ``units`` (the plan's FSDP units, those of ``net``) with the units
    that share a parameter merged into one group, as a tied embedding and head are one unit
    (FSDP2 refuses a parameter two groups manage: ALBERT-style blocks sharing one linear,
    one ``nn.Parameter`` in two layers); in plan order, each group where its first unit is.
    A group that shares a parameter with a module outside every unit is left to the unit
    that holds that module (the root's): ``unsharded`` names those units."""
    modules = dict(net.named_modules())
    present = [u for u in units if u in modules]
    owners: dict[int, set[str]] = {}  # parameter -> the units (or "" outside) that use it
    for name, param in net.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(_under(name, present) or "")
    parent = {u: u for u in [*present, ""]}

    def find(u: str) -> str:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for users in owners.values():
        first, *rest = sorted(users)
        for other in rest:
            parent[find(other)] = find(first)
    groups: dict[str, list[str]] = {}
    for unit in present:
        groups.setdefault(find(unit), []).append(unit)
    outside = find("")
    unsharded = groups.pop(outside, []) if outside in groups else []
    return list(groups.values()), unsharded


def shared_parameter_note(net: torch.nn.Module, group: Sequence[str]) -> str:
    """``name (in a, b)`` for the first parameter a unit of ``group`` shares (with another of
    them, or with a module outside them), for messages."""
    users: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        unit = _under(name, group) or name.rpartition(".")[0] or "the model"
        if unit not in users.setdefault(id(param), []):
            users[id(param)].append(unit)
            first.setdefault(id(param), name)
    for key, where in users.items():
        if len(where) > 1 and any(u in group for u in where):
            return f"{first[key]} (in {', '.join(where)})"
    return ", ".join(group)


def shard_units(
    net: torch.nn.Module, units: Sequence[str], options: dict, *, edge_units: bool = False
) -> None:
    """FSDP2 ``fully_shard`` on each of ``units`` of ``net`` (a unit missing from ``net``, or
    a pipeline stage's pass-through, is skipped), units sharing a parameter as one group
    (``fsdp_unit_groups``); then, with ``edge_units``, torchtitan's units outside them
    (``shard_edge_units``). A unit sharing a parameter with the parts outside every unit is
    left to the root's unit (refused with ``edge_units``, before anything is sharded)."""
    from torch.distributed.fsdp import fully_shard

    from memplan.run.pipeline import SkippedLayer

    named = dict(net.named_modules())
    real = [u for u in units if u in named and not isinstance(named[u], SkippedLayer)]
    groups, unsharded = fsdp_unit_groups(net, real)
    if edge_units:
        refuse_shared_edges(net, unsharded)
    for group in groups:
        members = [named[u] for u in group]
        fully_shard(members if len(members) > 1 else members[0], **options)
    if edge_units:
        shard_edge_units(net, units, options)


def refuse_shared_edges(net: torch.nn.Module, unsharded: Sequence[str]) -> None:
    """torchtitan's edge units cannot take a layer that shares a parameter with the
    embeddings or the head (the layer would be in the root's unit, the parameter in an edge
    unit's too): refuse before anything runs."""
    if unsharded:
        raise BadInputError(
            f"The FSDP units {', '.join(unsharded)} share a parameter with a module outside "
            f"the plan's layers ({shared_parameter_note(net, unsharded)}), which "
            "parallel.fsdp_units torchtitan-2507 shards as a unit of its own; FSDP2 lets one "
            "unit only manage a parameter.",
            hint="Solve with --fsdp-units memplan (the root's unit then holds the shared "
            "parameter and the layers that use it), or untie the parameter.",
        )


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
    # one all-gather unit per layer (layers sharing a parameter: one unit), then the root
    layout = getattr(plan, "parallel", None)
    edges = layout is not None and layout.edge_units
    shard_units(net, plan.shard_units, options, edge_units=edges)
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
    model = PlanDDP(net, device_ids=ids, gradient_as_bucket_view=True)
    optimizer = make_optimizer(net)
    if strategy == "zero1":
        optimizer = zero_redundancy(optimizer)
    return model, optimizer


def zero_redundancy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` as ``ZeroRedundancyOptimizer`` of its class: every parameter group with
    all its options (a group's own lr, weight decay, betas: a head frozen by ``lr: 0`` stays
    frozen), the class's defaults for the rest."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {
        k: v for k, v in optimizer.defaults.items() if k in accepted and k != "differentiable"
    }
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(group["params"])}
        for group in optimizer.param_groups
    ]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)


UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"


class PlanDDP(torch.nn.parallel.DistributedDataParallel):
    """torch's ``DistributedDataParallel`` (``find_unused_parameters=False``, whose
    all-reduce waits for every trainable parameter's gradient), whose error for a trainable
    parameter the loss never reaches (a pooler under MLM, a head another task uses) names
    those parameters and is the model file's (exit 2), not "Fix training_loss()" with
    DDP's text. It notes which parameters each backward reached (a hook per parameter that
    adds its id to a set), as the optimizer's ``zero_grad(set_to_none=True)`` leaves no
    gradient to look at when DDP's next forward refuses."""

    def __init__(self, module: torch.nn.Module, **options: Any) -> None:
        super().__init__(module, **options)
        self._reached: set[int] = set()
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._note_reached)

    def _note_reached(self, param: torch.Tensor) -> None:
        self._reached.add(id(param))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            out = super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            if UNFINISHED_REDUCTION not in str(exc):
                raise
            raise unused_parameters_error(self.module, self._reached) from None
        self._reached.clear()  # the backward of this forward notes afresh
        return out


def unused_parameters_error(net: torch.nn.Module, reached: set[int]) -> BadInputError:
    """Why DDP stopped: the trainable parameters of ``net`` that the last backward did not
    reach (``reached``: the ids of those it did)."""
    unused = [n for n, p in net.named_parameters() if p.requires_grad and id(p) not in reached]
    shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
    what = (
        f"the trainable parameters {shown} get no gradient"
        if unused
        else "some trainable parameters get no gradient"
    )
    return BadInputError(
        f"DDP cannot train this model: {what} from training_loss() (the loss never uses "
        "them), and DistributedDataParallel all-reduces a step's gradients only once every "
        "trainable parameter has one.",
        hint="Set requires_grad False on them in build_model() (or drop the modules the loss "
        "does not use), or plan with --strategy fsdp, which does not wait for them.",
    )
