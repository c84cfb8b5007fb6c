"""memplan: a memory planner and auto-tuner for PyTorch training.

The core (profile, memory, timing, solver, plan, emit) imports neither torch nor rich. The
run-time helpers that do (``apply``, ``remove``, ``Accumulator``: memplan.run) and
``plan_model`` (memplan.integrations.api: plan a live model from a training script) are
loaded on first use; no training framework is imported by ``import memplan``."""

from __future__ import annotations

from typing import Any

from memplan.plan import Plan, load_plan
from memplan.profile import Profile, load_profile
from memplan.version import __version__

_RUNTIME = {"apply", "remove", "Accumulator"}
_INTEGRATIONS = {"plan_model", "profile_model"}

__all__ = [
    "Plan",
    "Profile",
    "load_plan",
    "load_profile",
    "__version__",
    *sorted(_RUNTIME | _INTEGRATIONS),
]


def __getattr__(name: str) -> Any:
    if name in _RUNTIME:
        from memplan import run

        return getattr(run, name)
    if name in _INTEGRATIONS:
        from memplan.integrations import api

        return getattr(api, name)
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")
