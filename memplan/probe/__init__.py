"""The probe: measure a model's memory and time per layer and write a Profile.

The only heavy torch code in memplan. ``probe_model`` measures; ``measure_training_peak``
runs real training steps of a plan-like configuration under the same tracker, so that
predicted and measured peaks come from one instrument. Names are loaded on first use, so
``memplan.probe.settings`` (what ``memplan check``'s parent process keys probes by) costs no
torch import.
"""

from __future__ import annotations

from memplan.lazy import loader

_HOMES = {
    "MeasuredRun": "measure",
    "measure_training_peak": "measure",
    "probe_model": "runner",
}

__all__ = sorted(_HOMES)


__getattr__ = loader(__name__, _HOMES)
