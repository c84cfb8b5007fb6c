"""The plan itself, as ``plan.yaml``: the source the other formats are derived from."""

from __future__ import annotations

from memplan.plan import Plan, plan_to_yaml

STRATEGIES = frozenset({"ddp", "zero1", "zero2", "fsdp"})
"""Plan strategies this format writes faithfully: the plan itself names any strategy."""


def emit_plan(plan: Plan, *, model_path: str | None = None) -> str:
    """``plan.yaml`` text; ``model_path`` is unused (the plan already names its model)."""
    del model_path
    return plan_to_yaml(plan)
