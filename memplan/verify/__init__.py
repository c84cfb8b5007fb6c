"""The torch wing that proves a plan: run it for real, in one process
(memplan.verify.single) or one process per rank (memplan.verify.distributed, with the
ranks' gradient check in memplan.verify.distributed_grads and their lifetime in
memplan.verify.rank_lifetime), and compare measured with predicted. ``run_verify`` picks
the engine; a result's ``json_data()`` is what ``--json`` prints."""

from __future__ import annotations

from typing import Any

from memplan.plan import Plan
from memplan.verify.distributed import DistributedVerifyResult, verify_distributed
from memplan.verify.grad_check import BatchCoupling, GradientCheck
from memplan.verify.single import (
    GRAD_TOLERANCE,
    VerifyResult,
    last_step_timeline,
    verify_plan,
)

__all__ = [
    "GRAD_TOLERANCE",
    "BatchCoupling",
    "DistributedVerifyResult",
    "GradientCheck",
    "VerifyResult",
    "last_step_timeline",
    "run_verify",
    "verify_distributed",
    "verify_plan",
]


def run_verify(
    model: str,
    plan: Plan,
    *,
    world_size: int | None = None,
    timeout_s: float = 300.0,
    **options: Any,
) -> VerifyResult | DistributedVerifyResult:
    """Run ``plan`` for ``model``: in this process when it has one rank (``world_size``,
    default the plan's), else one process per rank, killed after ``timeout_s``."""
    if (world_size or plan.world_size) <= 1:
        return verify_plan(model, plan, **options)
    return verify_distributed(model, plan, world_size=world_size, timeout_s=timeout_s, **options)
