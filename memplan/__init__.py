"""memplan: a memory planner and auto-tuner for PyTorch training.

The core (profile, memory, timing, solver, plan, emit) imports neither torch nor rich. The
run-time helpers that do (``apply``, ``remove``, ``Accumulator``: memplan.run) and
``plan_model`` (memplan.integrations.api: plan a live model from a training script) are
loaded on first use; no training framework is imported by ``import memplan``."""

from __future__ import annotations

from memplan.lazy import loader
from memplan.plan import Plan, load_plan
from memplan.profile import Profile, load_profile
from memplan.version import __version__

_HOMES = {
    **dict.fromkeys(("apply", "remove", "Accumulator"), "memplan.run"),
    **dict.fromkeys(("plan_model", "profile_model"), "memplan.integrations.api"),
}

__all__ = ["Plan", "Profile", "load_plan", "load_profile", "__version__", *sorted(_HOMES)]

__getattr__ = loader(__name__, _HOMES)
