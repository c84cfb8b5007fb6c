"""Accelerate: the plan as ``Accelerator`` arguments (issue 32).

The documented pattern (README, "Accelerate")::

    plan = memplan.plan_model(model, batch_fn, loss_fn=loss_fn, optimizer=optimizer,
                              budget="20GiB", target_batch=64)
    accelerator = Accelerator(**accelerator_kwargs(plan))   # gradient_accumulation_steps
    prepare_model(model, plan)                              # memplan.apply: the planned layers
    loader = DataLoader(dataset, batch_size=plan.micro_batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()

``accelerator_kwargs`` needs no accelerate; ``accelerator(plan, **kwargs)`` builds the
Accelerator itself and says which extra to install when accelerate is missing.

A float8 plan (``plan.float8``: the probe ran the linears as torchao's ``Float8Linear``) is
carried by ``prepare_model``: it converts the same linears with the same recipe as the probe
did (memplan.run.float8, torchtitan's filter), and the Accelerator keeps the plan's ``bf16``
for everything else. Accelerate's own ``mixed_precision="fp8"`` is not used: its torchao
filter (``accelerate.utils.ao.filter_linear_layers``) leaves other linears out than the ones
the plan was measured with.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.integrations.extras import require
from memplan.plan import Plan
from memplan.run.checkpoint import apply
from memplan.run.float8 import convert_for_plan

__all__ = ["accelerator", "accelerator_kwargs", "prepare_model"]

_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def accelerator_kwargs(plan: Plan) -> dict[str, Any]:
    """``Accelerator(**accelerator_kwargs(plan))``: the plan's accumulation steps and mixed
    precision, and for a plan timed compiled (``probe --compiled``) the inductor backend.
    The DataLoader's ``batch_size`` is ``plan.micro_batch_size`` (per process); a float8
    plan's linears are converted by ``prepare_model`` (module docstring)."""
    _check_plan("accelerator_kwargs", plan)
    kwargs: dict[str, Any] = {
        "gradient_accumulation_steps": plan.accumulation_steps,
        "mixed_precision": _MIXED_PRECISION[plan.precision],
    }
    if plan.compiled:
        kwargs["dynamo_backend"] = "inductor"
    return kwargs


def accelerator(plan: Plan, **kwargs: Any) -> Any:
    """An ``accelerate.Accelerator`` with ``accelerator_kwargs(plan)`` (``kwargs`` added)."""
    accelerate = require("accelerate", "memplan.integrations.accelerate.accelerator")
    _check_plan("accelerator", plan)
    return accelerate.Accelerator(**{**accelerator_kwargs(plan), **kwargs})


def prepare_model(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """``model`` with exactly the plan's layers checkpointed (``memplan.apply``) and, for a
    float8 plan, the linears the probe converted converted to torchao's ``Float8Linear``
    (once: a model already converted is left as it is); call it before
    ``accelerator.prepare``. Returns the model."""
    _check_plan("prepare_model", plan)
    if not isinstance(model, torch.nn.Module):
        raise BadInputError(
            f"prepare_model() takes the nn.Module to train, got {type(model).__name__}.",
            hint="Call prepare_model(model, plan) before accelerator.prepare(model, ...).",
        )
    if plan.float8 is not None and not _has_float8(model):
        cuda = torch.cuda.is_available()
        if plan.float8.fsdp_float8_all_gather and plan.strategy == "fsdp" and not cuda:
            raise BadInputError(
                "The plan was measured with float8 linears whose weights FSDP2 all-gathers in "
                "float8 (torchao's enable_fsdp_float8_all_gather), which needs CUDA: gloo, the "
                "CPU backend, has no float8 dtype, and no CUDA device is visible here.",
                hint="Train this plan on CUDA GPUs; on this machine plan with strategy='ddp' "
                "or without precision='float8'.",
            )
        convert_for_plan(model, plan, torch.device("cuda" if cuda else "cpu"))  # as probed
    apply(model, plan)
    return model


def _check_plan(owner: str, plan: Any) -> None:
    if not isinstance(plan, Plan):
        raise BadInputError(
            f"{owner}() takes a memplan Plan, got {type(plan).__name__}.",
            hint="Pass the plan memplan.plan_model(...) returns, or memplan.load_plan(path) "
            "of a plan file memplan wrote.",
        )


def _has_float8(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())
