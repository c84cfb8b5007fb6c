"""The probe: measure a model's memory and time per layer and write a Profile.

The only heavy torch code in memplan. ``probe_model`` measures; ``measure_training_peak``
runs real training steps of a plan-like configuration under the same tracker, so that
predicted and measured peaks come from one instrument. Names are loaded on first use, so
``memplan.probe.settings`` (what ``memplan check``'s parent process keys probes by) costs no
torch import.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "MeasuredRun": "measure",
    "measure_training_peak": "measure",
    "probe_model": "runner",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"memplan.probe.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'memplan.probe' has no attribute {name!r}")
