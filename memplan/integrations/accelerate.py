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
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.integrations.extras import require
from memplan.plan import Plan
from memplan.run.checkpoint import apply

__all__ = ["accelerator", "accelerator_kwargs", "prepare_model"]

_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def accelerator_kwargs(plan: Plan) -> dict[str, Any]:
    """``Accelerator(**accelerator_kwargs(plan))``: the plan's accumulation steps and mixed
    precision, and for a plan timed compiled (``probe --compiled``) the inductor backend.
    The DataLoader's ``batch_size`` is ``plan.micro_batch_size`` (per process)."""
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
    return accelerate.Accelerator(**{**accelerator_kwargs(plan), **kwargs})


def prepare_model(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """``model`` with exactly the plan's layers checkpointed (``memplan.apply``); call it
    before ``accelerator.prepare``. Returns the model."""
    apply(model, plan)
    return model
